import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter, which must be chosen before triton is
# first imported: here, ahead of any test module (one that merely probes triton at collection
# would otherwise fix the compiled mode for the modules after it).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter re-patches `triton.language` at every call of a nested @jit function
    (an `inspect.getmembers` walk of the language modules, about 10 ms each: most of an SGMV
    kernel's interpreted time), though the launch already patched the same modules and restores
    them when it ends. Within a launch, patch each module's globals once. Semantics are
    unchanged; on a Triton without these internals nothing is done."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    executor = getattr(interpreter, "GridExecutor", None)
    patch = getattr(interpreter, "_patch_lang", None)
    if executor is None or patch is None:
        return
    launch = executor.__call__
    patched: set[int] | None = None  # ids of the globals patched in the running launch

    def patch_once(fn):
        if patched is not None and id(fn.__globals__) in patched:
            return None  # a nested call: its caller discards the scope
        scope = patch(fn)
        if patched is not None:
            patched.add(id(fn.__globals__))
        return scope

    def run_launch(self, *args, **kwargs):
        nonlocal patched
        outer, patched = patched, set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched = outer

    interpreter._patch_lang = patch_once
    executor.__call__ = run_launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()

# Under pytest-xdist every worker is a process of its own: share the cores among them rather
# than let each run torch's intra-op pool over all of them.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the slow tier (tests marked slow: minutes each, e.g. the soak)",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the markers
def pytest_collection_modifyitems(config, items):
    if not config.getoption("--slow"):  # the slow tier is deselected, not skipped
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    gpu = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "serve" in item.keywords:
            # A module that starts Ray Serve keeps its tests on one worker: its cluster is a
            # module fixture, built once; the end-to-end modules share one cluster (a session
            # fixture), so they share one worker.
            module = item.module.__name__
            group = "serve:e2e" if module.startswith("tests.e2e.") else f"serve:{module}"
            item.add_marker(pytest.mark.xdist_group(group))
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip)
    # The Serve modules first: xdist hands out groups in this order, and those modules spend
    # much of their time waiting on their clusters, which the other tests then fill.
    items.sort(key=lambda item: "serve" not in item.keywords)
