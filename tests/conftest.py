import os
import zlib

import numpy as np
import pytest
import torch

import flashlab  # noqa: F401  (settles GPU vs interpreter before any kernel import)
from flashlab import device


def _descriptors() -> bool:
    """Whether this Triton has tensor descriptors (3.4 on): without them the plan runs the pointer versions."""
    try:
        from flashlab.kernels import plan
    except ImportError:      # no Triton: the tests that need it skip themselves
        return True
    return plan.DEVICE_DESCRIPTORS and plan.device_facts().host_descriptors


AUTO_XDIST = pytest.StashKey[bool]()
ONE_WORKER = ("tests/test_browser.py", "tests/test_site.py")   # one worker runs these, in this order


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (``python -m pytest`` with no paths) runs on every core through pytest-xdist, which
    requirements.txt installs: about 18 minutes instead of 30 on two cores (at most 4 workers beside a GPU).
    Paths, ``-n``, ``--dist`` or ``--pdb`` given, or xdist absent: pytest runs as asked."""
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.option.numprocesses is None and config.option.dist == "no"
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("usepdb", False)):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if device.DEVICE.type == "cuda":
            cores = min(cores, 4)      # the workers share one GPU, each with a CUDA context of its own
        if cores > 1:
            config.option.numprocesses = cores
            config.option.dist = "load"
            config.stash[AUTO_XDIST] = True


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With the suite spread (above): every test on its own, except ONE_WORKER's, which one worker runs in
    collection order -- the site is built from the notebooks the browser test just executed, in that worker's
    temporary directory.  (A scheduler of the controller's: xdist's ``loadgroup`` needs ``--dist`` on the
    command line, which the workers parse again.)"""
    if not config.stash.get(AUTO_XDIST, False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class BrowserThenSite(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return "browser, then site" if nodeid.startswith(ONE_WORKER) else nodeid

    return BrowserThenSite(config, log)


@pytest.fixture(autouse=True)
def _sandbox_turns(request):
    """Under pytest-xdist, a test marked ``sandbox_alone`` (it asserts that no sandbox process is left
    anywhere on the machine) runs while no other test runs: it takes a lock file exclusively, every other
    test shares it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    import fcntl
    import tempfile
    with open(os.path.join(tempfile.gettempdir(), "flashlab-tests-sandbox.lock"), "w") as f:
        alone = request.node.get_closest_marker("sandbox_alone") is not None
        fcntl.flock(f, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
    no_descriptors = None if _descriptors() else pytest.mark.skip(
        reason="needs tensor descriptors (Triton >= 3.4); this Triton's plan runs the pointer versions")
    gpu = None if device.DEVICE.type == "cuda" else pytest.mark.skip(reason="needs a CUDA GPU (compiled Triton)")
    for item in items:
        if gpu is not None and "gpu" in item.keywords:
            item.add_marker(gpu)
        if no_descriptors is not None and "descriptors" in item.keywords:
            item.add_marker(no_descriptors)


@pytest.fixture
def rng(request):
    """Random data per test, reproducible from the test's name (crc32: str hash() is salted per process)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return np.random.default_rng(seed)
