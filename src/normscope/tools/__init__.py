"""The applications built on the library: they use its public API and nothing of its internals.

* :mod:`~normscope.tools.tour` and :mod:`~normscope.tools.explain` -- ``normscope tour`` / ``explain``;
* :mod:`~normscope.tools.named` -- the teaching metadata of the registry's names, read by explain, viz and explorer;
* :mod:`~normscope.tools.viz` -- pictures of scopes (``normscope draw``);
* :mod:`~normscope.tools.explorer` -- the local web page (``normscope explore``);
* :mod:`~normscope.tools.bench` -- the benchmark (``normscope bench``);
* :mod:`~normscope.tools.lab` -- small training runs that reproduce the classic claims (``normscope lab``).

Nothing is imported here: each application pays for its own imports when it runs.
"""
