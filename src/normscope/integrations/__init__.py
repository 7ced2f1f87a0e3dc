"""Integrations with other libraries: patching Hugging Face ``transformers`` models
(:mod:`normscope.integrations.transformers`). Each submodule imports its library lazily, so
``import normscope`` never requires them; install with ``pip install normscope[integrations]``.
"""

__all__ = ["transformers"]
