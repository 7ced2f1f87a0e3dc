"""Shared helpers for the core test suite: an independent float64 formula and tolerances.

``direct`` is written from the definition (permute the reduced axes to the end, flatten them,
sum / count), deliberately *not* through :mod:`normscope.reference`, so that the reference itself
is checked against something independent.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

# OpenMP threads that wait at a barrier sleep rather than spin. libgomp reads this when torch loads it: in
# this process when nothing imported torch before this file, and in the pytest-xdist workers and the tests'
# subprocesses, which inherit it. The suite runs one worker per core and each keeps torch's intra-op threads,
# so a spinning waiter takes a core from a thread of the other worker, or of anything else the machine runs:
# on 2 shared cores the most threaded test files took 2-3x the wall time and CPU time, and single tests up to
# 50x. It changes no thread count and no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton picks interpreter or compiler when a kernel is *decorated*, i.e. when normscope (and with it
# normscope.kernels) is first imported -- which this file does, before any test module can choose.
# Without a GPU the interpreter is the only way the kernels run; with one, the environment decides.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# ---------------------------------------------------------------------------------------------
# how the suite runs (README "Set up", tests/README.md "Running")
#
# * On every core: ``-n auto --dist loadgroup`` (pytest-xdist; pytest_cmdline_main below). Each worker is a
#   process of its own, so what a test sets process-wide (the environment, torch's global settings, the
#   forced backend) stays in its worker, as in a run in one process; tests that must share one process --
#   a page's documentation blocks, the readers of one expensive module fixture -- carry
#   ``pytest.mark.xdist_group`` and run on one worker, in order. torch keeps its own intra-op thread count
#   in every worker: normscope decides per call from it (a lone sample is paired with two threads and
#   more: normscope._registry), so fewer threads would change which paths the suite runs.
# * ``smoke`` (marker): a run of a whole tool on tiny sizes; left out of the README's command, run by CI
#   (.ci/run: ``python3 -m pytest -m smoke``). See pytest_collection_modifyitems below.
# * Property tests (hypothesis) draw as many examples as the profile ``NORMSCOPE_HYPOTHESIS`` names:
#   ``quick`` (the default, the README's command) or ``ci`` (.ci/run sets it): hypothesis_examples().

#: examples per property test: a test written ``hypothesis_examples(n)`` draws n in CI, n // 5 (at least
#: 10) in the README's command; a test that sets no number draws the profile's ``max_examples``
HYPOTHESIS_PROFILES = {"quick": 20, "ci": 100}
HYPOTHESIS_PROFILE = os.environ.get("NORMSCOPE_HYPOTHESIS", "quick")


def hypothesis_examples(ci: int) -> int:
    """The examples a property test draws: ``ci`` under the ``ci`` profile, a fifth (at least 10) under
    ``quick``."""
    return ci if HYPOTHESIS_PROFILE == "ci" else min(ci, max(10, ci // 5))


def _load_hypothesis_profile() -> None:
    try:
        from hypothesis import settings
    except ImportError:  # the property tests import hypothesis themselves and fail with its name
        return
    for name, n in HYPOTHESIS_PROFILES.items():
        settings.register_profile(name, max_examples=n)
    if HYPOTHESIS_PROFILE in HYPOTHESIS_PROFILES:  # else pytest_configure refuses the run
        settings.load_profile(HYPOTHESIS_PROFILE)


_load_hypothesis_profile()

#: Device of the kernel tests' tensors (tests/kernels/test_kernels.py): "cpu" runs the kernels in Triton's
#: interpreter; ``NORMSCOPE_TEST_DEVICE=cuda`` runs them compiled on the GPU (same assertions, plus
#: larger shapes). Other test modules ignore it.
TEST_DEVICE = os.environ.get("NORMSCOPE_TEST_DEVICE", "cpu")
_TESTS = Path(__file__).resolve().parent


def kernel_interpreter_env(previous):
    """Body of the kernel test modules' module-scoped fixture: on CPU, keep TRITON_INTERPRET=1 while
    the module's tests run (the Triton backend reads it per call), then put back ``previous`` -- what
    the session had when the module was imported -- so later test modules see the environment they
    expect."""
    if TEST_DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    yield
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture(scope="module", autouse=True)
def _kernel_module_interpreter(request):
    """The opening every module of tests/kernels/ shares (:func:`kernel_interpreter_env`), given here
    rather than by a conftest.py of that folder: a second conftest module would take the name
    ``conftest`` from this one, and making the folder a package to avoid it would put a top-level
    package named ``kernels`` on ``sys.path`` (the name of Hugging Face's kernels library, whose
    presence transformers probes)."""
    if request.node.path.parent.name != "kernels" or request.node.path.parent.parent != _TESTS:
        yield
        return
    yield from kernel_interpreter_env(os.environ.get("TRITON_INTERPRET"))


from normscope import engine  # noqa: E402

BACKENDS = ("aten", "reference")

#: ``NORMSCOPE_TEST_KERNEL_VARIANTS=channels:split,groups:onchip`` (or ``rows:rows_once``) runs the kernel tests
#: (tests/kernels/) and the differential suite (tests/conformance/) with those kernel variants pinned
#: (kernels/config.py's ``<FAMILY>_VARIANT``, normscope.kernels.variants):
#: the tests that reach the kernels through the engine (the Triton backend) held to the candidates; tests
#: that call a kernel module directly or spy on the default kernels by name still run (or expect) the default
KERNEL_VARIANTS = dict(
    item.split(":", 1) for item in os.environ.get("NORMSCOPE_TEST_KERNEL_VARIANTS", "").split(",") if ":" in item
)


@pytest.fixture(autouse=True)
def _kernel_variants(request, monkeypatch):
    """The pins of ``NORMSCOPE_TEST_KERNEL_VARIANTS`` for every test of tests/kernels/ and tests/conformance/
    (none by default)."""
    where = request.node.path.parents
    if KERNEL_VARIANTS and (_TESTS / "kernels" in where or _TESTS / "conformance" in where):
        from normscope.kernels import config, variants

        for family, name in KERNEL_VARIANTS.items():
            monkeypatch.setattr(config, variants.KNOBS[family], name)
    yield


@pytest.fixture(autouse=True)
def _clean_backend_state(monkeypatch):
    """No test sees another's forced backend or environment variable."""
    monkeypatch.delenv(engine.ENV_VAR, raising=False)
    token = engine._FORCED.set(None)
    yield
    engine._FORCED.reset(token)


def direct(
    x: torch.Tensor,
    reduce: tuple[int, ...],
    centered: bool = True,
    groups: int = 1,
    group_dim: int = 1,
    affine: tuple[int, ...] = (),
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalization in float64 straight from the formula.

    ``reduce`` are non-negative axes of ``x``; with ``groups > 1`` the ``group_dim`` axis (which
    must be in ``reduce``) is split into ``groups`` contiguous groups. Elements of an empty
    (all-masked) scope get output 0 before the affine.
    """
    x = x.detach().double()
    shape = tuple(x.shape)
    nd = x.dim()
    m = torch.ones(shape, dtype=torch.float64, device=x.device) if mask is None else mask.expand(shape).double()
    reduce = sorted(a % nd for a in reduce)
    if groups > 1:
        gd = group_dim % nd
        assert gd in reduce
        gshape = shape[:gd] + (groups, shape[gd] // groups) + shape[gd + 1 :]
        xs, ms = x.reshape(gshape), m.reshape(gshape)
        red = [a if a < gd else a + 1 for a in reduce if a != gd] + [gd + 1]
    else:
        xs, ms, red = x, m, list(reduce)
    keep = [a for a in range(xs.dim()) if a not in red]
    perm = keep + red
    xp, mp = xs.permute(perm), ms.permute(perm)
    pshape = xp.shape
    kshape = tuple(pshape[: len(keep)])
    xf, mf = xp.reshape(kshape + (-1,)), mp.reshape(kshape + (-1,))
    n = mf.sum(-1, keepdim=True)
    if centered:
        mean = (xf * mf).sum(-1, keepdim=True) / n.clamp(min=1)
    else:
        mean = torch.zeros_like(n)
    var = ((xf - mean) ** 2 * mf).sum(-1, keepdim=True) / n.clamp(min=1)
    y = (xf - mean) / torch.sqrt(var + eps)
    y = torch.where(n > 0, y, torch.zeros_like(y))
    inv = [perm.index(i) for i in range(len(perm))]
    y = y.reshape(pshape).permute(inv).reshape(shape)
    view = [shape[d] if d in affine else 1 for d in range(nd)]
    if weight is not None:
        y = y * weight.detach().double().reshape(view)
    if bias is not None:
        y = y + bias.detach().double().reshape(view)
    return y


# tolerances for comparing against torch.nn computed in the same dtype (fp64/fp32), and the extra
# absolute slack allowed on top of 2x torch's own error for half types
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-4, atol=1e-5),
}
HALF_ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(actual, expected, dtype=None, **kw):
    dtype = dtype or (actual.dtype if isinstance(actual, torch.Tensor) else torch.float32)
    tol = dict(TOL.get(dtype, TOL[torch.float32]))
    tol.update(kw)
    torch.testing.assert_close(actual, expected, **tol)


def assert_half_close(ours, torch_same_dtype, torch_fp32, dtype, what=""):
    """Flash-attention style: our error against the fp32 computation is at most twice torch's
    own error in the same low-precision dtype, plus a small absolute slack."""
    ours_err = (ours.float() - torch_fp32.float()).abs().max().item()
    torch_err = (torch_same_dtype.float() - torch_fp32.float()).abs().max().item()
    bound = 2 * torch_err + HALF_ATOL[dtype]
    assert ours_err <= bound, f"{what}: error {ours_err:.3g} > 2 x torch's {torch_err:.3g} + {HALF_ATOL[dtype]}"


def pytest_report_header(config):
    return (
        f"torch {torch.__version__}, NORMSCOPE_BACKEND={os.environ.get(engine.ENV_VAR)!r}, "
        f"kernel tests on {TEST_DEVICE} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})"
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns "auto" into a number
def pytest_cmdline_main(config):
    """One worker process per core, tests with an ``xdist_group`` mark on one worker: ``-n auto --dist
    loadgroup`` unless the command line gives ``-n`` (``-n 0``: one process) or ``--dist``. Here rather than
    in pyproject's addopts so that pytest still runs, in one process, where pytest-xdist is not installed
    (``-p no:xdist`` too)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # a worker parses the command line again, without what was chosen here
        if workerinput.get("normscope_dist") == "loadgroup":
            config.option.loadgroup = True  # pytest-xdist's worker then names each test's group
        return
    if config.option.numprocesses is None and not config.option.tx:
        config.option.numprocesses = "auto"
    if config.option.numprocesses and config.option.dist == "no":
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin it is never called
def pytest_configure_node(node):
    """Hands the distribution mode chosen in pytest_cmdline_main to each worker."""
    node.workerinput["normscope_dist"] = node.config.option.dist


def pytest_configure(config):
    if TEST_DEVICE not in ("cpu", "cuda"):
        raise pytest.UsageError(f"NORMSCOPE_TEST_DEVICE: expected 'cpu' or 'cuda', got {TEST_DEVICE!r}")
    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"NORMSCOPE_TEST_DEVICE=cuda, but torch {torch.__version__} sees no CUDA device "
            "(torch.cuda.is_available() is False)"
        )
    if TEST_DEVICE == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        raise pytest.UsageError(
            "NORMSCOPE_TEST_DEVICE=cuda with TRITON_INTERPRET=1 would run the interpreter, not the compiled "
            "kernels: unset TRITON_INTERPRET"
        )
    config.addinivalue_line("markers", "slow: takes tens of seconds (torch.compile); deselect with -m 'not slow'")
    config.addinivalue_line(
        "markers",
        "smoke: a run of a whole tool (the bench, the lab, a benchmark script) on tiny sizes; left out unless -m "
        "names it (python3 -m pytest -m smoke); CI runs them",
    )
    if HYPOTHESIS_PROFILE not in HYPOTHESIS_PROFILES:
        raise pytest.UsageError(
            f"NORMSCOPE_HYPOTHESIS: expected one of {sorted(HYPOTHESIS_PROFILES)}, got {HYPOTHESIS_PROFILE!r}"
        )


def pytest_collection_modifyitems(config, items):
    """The smoke tests are left out unless ``-m`` names them (``-m smoke``, ``-m "smoke or not smoke"``) or
    the command line names tests one by one (``file::test``)."""
    if "smoke" in (config.getoption("markexpr") or "") or any("::" in str(a) for a in config.args):
        return
    smoke = [item for item in items if item.get_closest_marker("smoke")]
    if smoke:
        config.hook.pytest_deselected(items=smoke)
        items[:] = [item for item in items if not item.get_closest_marker("smoke")]


# ---------------------------------------------------------------------------------------------
# a headless Chromium for the end-to-end pages (tests/tools/test_explorer_browser.py,
# tests/doctor/test_doctor_browser.py): Debian's chromium + chromium-driver and the browser-test extra

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
#: where the browser tests leave their screenshots
ARTIFACTS = _TESTS.parent / "test-artifacts"

#: every browser test: a skip that says what to install, and one worker (pytest-xdist) for each file, whose
#: tests share one browser
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None or importlib.util.find_spec("selenium") is None,
    reason="needs Chromium and chromedriver (apt-get install chromium chromium-driver, or .ci/setup-browser.sh) "
    "and selenium (pip install 'normscope[browser-test]')",
)


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium driven by selenium, one per test module, with a profile of its own (removed
    after) and the browser's console log kept (tests fail on script errors). Nothing is downloaded: Selenium
    Manager is kept offline and the system's browser and driver are named."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download a browser or driver
    profile = tempfile.mkdtemp(prefix="normscope-chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-extensions",
        "--window-size=1280,1100",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # to fail on script errors and CSP violations
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(20)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``normscope ARGV...`` in this process: (exit status, stdout, stderr); argparse's exits included."""
    from normscope import cli

    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------------------------
# scope isolation: one sample alone and inside batches (tests/kernels/*invariance*)


def sample_alone_and_in_batches(fn, sample: torch.Tensor, batches) -> None:
    """``fn(xb) -> y`` on ``sample`` alone and inside each ``(batch size, position)`` of ``batches``,
    the other samples drawn from a fixed generator (a failure reproduces); asserts the sample's output
    and input gradient are bitwise equal in each. The output cotangent is the same in every batch."""
    g = torch.Generator().manual_seed(11)
    cots = []

    def run(xb: torch.Tensor, at: int):
        xb = xb.detach().requires_grad_(True)
        y = fn(xb)
        if not cots:  # an output's shape can differ from the input's
            cots.append(torch.randn(y.shape[1:], generator=g).to(sample.device, y.dtype))
        grad_out = torch.zeros_like(y)
        grad_out[at] = cots[0]
        (gx,) = torch.autograd.grad(y, xb, grad_out)
        return y[at].detach(), gx[at]

    alone_y, alone_g = run(sample[None], 0)
    for n, at in batches:
        rest = torch.randn((n - 1, *sample.shape), generator=g).to(sample.device, sample.dtype)
        xb = torch.cat([rest[:at], sample[None], rest[at:]])
        y, gx = run(xb, at)
        assert torch.equal(y, alone_y), f"batch {n}, position {at}: output differs from the sample alone"
        assert torch.equal(gx, alone_g), f"batch {n}, position {at}: input gradient differs from the sample alone"


# ---------------------------------------------------------------------------------------------
# the import graph of the package, read from its source (core/test_imports.py, backends/test_backends.py)

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

import normscope  # noqa: E402

#: the package's source folder
SRC = Path(normscope.__file__).resolve().parent
#: the engine's parts in their one-way order (each imports only those before it)
ENGINE_PARTS = ("_contract", "_state", "_registry", "_planning", "_capture", "engine")


def import_graph_module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph_is_module(name: str) -> bool:
    path = SRC.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_target(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` names, read in ``package`` (its dots resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def module_imports(path: Path) -> set[str]:
    """The normscope modules ``path`` imports (``from . import x`` as the module ``x`` when it is one)."""
    me = import_graph_module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, package)
            # `from . import rms`: the submodule itself; a name defined in the package: the package
            subs = [f"{target}.{a.name}" for a in node.names]
            real = [m for m in subs if import_graph_is_module(m)]
            found.update(real)
            if len(real) < len(subs):
                found.add(target)
    return {m for m in found if m.startswith("normscope")} - {me}


def state_of(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``m``'s state dict: what a refused call must leave as it found it."""
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def swap(name: str, value: object):
    """A mutation of a warm layer: its attribute ``name`` set to ``value`` (a tensor as a Parameter)."""

    def mutate(m: torch.nn.Module) -> None:
        setattr(m, name, torch.nn.Parameter(value) if isinstance(value, torch.Tensor) else value)

    return mutate


def refused_with_state_kept(m, mutate, x, exc, fragments) -> None:
    """``mutate(m)``, then ``m(x)`` raises ``exc`` naming every fragment, and no tensor of ``m``'s state
    moved (a meta tensor, or one moved to another device by ``mutate``, has no values to compare)."""
    mutate(m)
    before = state_of(m)
    with pytest.raises(exc) as info:
        m(x)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    after = state_of(m)
    for k, v in before.items():
        if v.device.type != "meta" and after[k].device == v.device:
            assert torch.equal(v, after[k]), f"{k} changed by a refused call"
