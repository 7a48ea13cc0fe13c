import os
import shutil
import tempfile

import torch

# tree="auto" measures each model's costs once and caches them in a file: here, one per test session,
# made by the process pytest started and shared by its pytest-xdist workers, which start after this
# file is read and inherit the variable (what one measured, the others read); removed at the end
_COSTS = "_STREE_TEST_COST_DIR"
_OWN_COSTS = _COSTS not in os.environ
if _OWN_COSTS:
    os.environ[_COSTS] = tempfile.mkdtemp(prefix="stree-costs-")
os.environ["STREE_CACHE_DIR"] = os.environ[_COSTS]
# ... in the fewest rounds (two, after each call's warm-up; an eager profile may leave its largest sizes
# out): a hundred models are measured here and no test reads their timings (those that do pass a budget)
os.environ.setdefault("STREE_COST_SECONDS", "0.1")

# Under pytest-xdist (setup.cfg runs a worker per core) each worker takes its share of the cores:
# workers that each spread their products over every core would only fight for them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_SHARE)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(_SHARE))  # (read when numba is first imported)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # triton.jit reads this when it decorates a kernel, so it must be set before any test module
    # imports stree.kernels.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def device():
    """Where the Triton kernels run: the GPU when there is one, else the CPU under the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def backend_device(request, device):
    """For a test parametrised by ``backend`` or ``kernel_backend``: the device its tensors go on,
    the kernel device for "triton" (where there is a GPU, Triton kernels take CUDA tensors only),
    else the CPU. As a context manager it makes that device the default for tensors built inside."""
    params = request.node.callspec.params
    backend = params.get("backend", params.get("kernel_backend"))
    return device if backend == "triton" else torch.device("cpu")


@pytest.fixture
def poison(monkeypatch):
    """Make every torch.empty/empty_like during the test return NaN (or -1 for integers), so an
    output element a kernel forgot to write cannot pass as a plausible value."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.dtype.is_floating_point else -1)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))


@pytest.fixture
def fixed_products(monkeypatch):
    """The CPU products' choice (stree.models.layers.linear) fixed from each key's first product, no
    trials in use after it: a test counting a call's ops counts the same ops whatever ran before."""
    import stree.models.layers.linear as lin

    monkeypatch.setattr(lin, "TRIALS", False)
    monkeypatch.setattr(lin, "_TRIALS", {})
    monkeypatch.setattr(lin, "_WON", {})  # (nor a verdict an earlier test left, taken at a call's start)


def pytest_sessionfinish(session):
    if _OWN_COSTS:
        shutil.rmtree(os.environ[_COSTS], ignore_errors=True)
