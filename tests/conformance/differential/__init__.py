"""The differential suite: every path of normscope against torch, and against itself.

Every op (``ops.OPS``) runs on every path that takes it (``ops.PATHS``: the automatic choice and
each backend forced -- ``aten``, ``composite`` for masked scopes, ``rows`` (the CPU RMS rows
backend, unmasked RMS scopes), ``reference``, and ``triton`` in Triton's interpreter,
``TRITON_INTERPRET=1`` as tests/conftest.py sets it on a machine without a GPU) with inputs drawn by
hypothesis: batch sizes 1..300, row lengths and spatial sizes around every threshold below, fp32,
fp64, bf16 and fp16 (the dtypes the path takes), and each tensor argument -- input, weight, bias,
running statistics, mask, modulations, q and k -- contiguous, strided, expanded (stride 0),
transposed, channels_last or at a storage offset.

The properties, one module each:

========================  ==========================================================================
``test_numbers``          (a) torch's numbers (or the model family's): bit for bit where normscope
                          promises them (a forced ``aten`` is torch's op; the families' casting
                          orders on the default path; fused_add's residual on every path), else no
                          further from a float64 computation than torch's own result in the same
                          dtype, plus a few ulps -- outputs, every gradient, running statistics
``test_isolation``        (b) a sample's output and input gradients bit for bit the same alone, at
                          another position and among other neighours (per-sample ops; BatchNorm in
                          training is cross-sample by design and is left out, as is AdaLayerNorm,
                          whose condition goes through ``nn.Linear``); (c) padded values (NaN, inf,
                          huge) change no bit of a valid output, gradient or running statistic
``test_determinism``      (d) the same call twice gives the same bits, weight gradients included
``test_threads``          (e) two threads at once, one forcing a backend or compiling
                          (``torch.compile(backend="aot_eager")``): the other's eager calls keep
                          their bits and their backend
``test_registry``         the table is whole and honest: every registered backend is a path, every
                          public name is an op (or in ``ops.NOT_OPS`` with its reason), each listed
                          path runs its op, and every unlisted backend refuses it (at the drawn sizes
                          and at ``ops.PAST_EVERY_THRESHOLD``, past the size of the automatic choice)
========================  ==========================================================================

**Registering a path or an op.** A new backend registered with the engine fails
``test_every_registered_backend_is_a_path`` until ``ops.PATHS`` names it; then every op that lists
it is checked for every property, with no test to write. A new public function or layer fails
``test_every_public_op_is_in_the_table`` until an ``ops.Op`` covers it: its ``draw`` (inputs as a
``harness.Case``), ``run``, ``oracle`` (torch's op or module, or the family's code, in the same
dtype; the float64 truth is the oracle on float64 inputs), its paths and its flags (``per_sample``,
``mask``, ``state``, ``bitwise``). A backend that starts taking an op it does not list fails
``test_every_unlisted_backend_refuses_the_op``.

**The size thresholds of the code**, and where the suite crosses each (drawn shapes give the small
side; ``ops.THRESHOLDS`` holds one large shape past each large threshold, and
``test_registry`` reads each value from the code and fails on a size constant the table does not name):

========================================  ===========  =============================================
threshold                                 value        crossed by
========================================  ===========  =============================================
``backends.rms.MIN_AUTO_ELEMENTS``        2^20 elems   THRESHOLDS: (300, 4096) fp32/bf16, the
(auto: ATen below, the rows path above)                family's (1, 1024, 1024); RMSNorm, poly_norm,
                                                       modulated_norm, fused_add at (300, 4096)
``backends.rms.BLOCKED_BYTES``            16 MiB       THRESHOLDS: (300, 16, 1024) fp32 (19.7 MB)
``backends.rms.BLOCK_ELEMENTS``           2^17 elems   THRESHOLDS: (300, 4096) bf16 (10 blocks)
``backends.rms.DW_GROUP_ROWS``            16 rows      drawn row counts (1..300 x middle axes)
``backends.aten._BOUNDED_MAX``            512 stats    THRESHOLDS: layer_norm (600, 8), group_norm
                                                       (300, 4, 2), instance_norm (200, 4, 3)
``backends.aten._CANCEL_LIMIT``           1024         drawn inputs of offset 10^4x their spread
                                                       (ops.SCALES; |mean| * rstd ~3000)
``_registry.SPLIT_ELEMENTS`` (and rms's)  32768        THRESHOLDS: a sample of 33000 (layer_norm,
                                                       rms_norm, group_norm): alone, it runs paired
``backends.composite.SUM_BLOCK``          16384 pos.   THRESHOLDS: masked instance/group norm over
                                                       16500 positions
``kernels.config.ROWS_MAX_FUSED_N``       16384        scaled to 8 in the interpreter (TRITON_SCALED)
``kernels.config.ROWS_TILE`` /            4096 / 64    TINY_ROW_LENGTHS 1, 3, 8, 9, 33 (rows packed
``ROWS_MAX_BLOCK_M``                                   per program change at powers of two)
``kernels.config.GROUPS_CL_MIN_SPLIT`` /  8192 / 1024  scaled to 16 / 8 in the interpreter
``GROUPS_CL_PROGRAMS``                                 (TRITON_SCALED), channels_last input
``kernels.config.INTERPRETER_PROGRAMS``   4            drawn batches of 1..32 rows/scopes
========================================  ===========  =============================================

Budget: hypothesis runs derandomized with no database and a few examples per test and path
(``conftest.EXAMPLES``; ``NORMSCOPE_DIFF_EXAMPLES`` / ``NORMSCOPE_DIFF_SEED`` widen a run),
inputs capped at ``ops.CAP`` elements (``ops.TINY_CAP`` in the interpreter),
so that the suite fits CI's minutes on two cores.
"""
