"""cuda_ext: our GPU projection kernels.

Without a GPU (CI, the development machine) this checks what can be checked there:
* the host build of cuda_ext/counter_hash.h (the header the kernels use) gives the same words, keys,
  signs, normals and SJLT entries as trak_core.projection.counter_rng (g++);
* kernels.cu compiles with nvcc for sm_80 and sm_90, and binding.cpp compiles against this torch and links
  with it into an importable module (nvcc, g++);
* the pure-torch path (the build-free GPU path, run here on the CPU) and the SJLT plan equal the definition;
* without CUDA the GPU projectors fall back to trak_core's CPU projectors with a one-line warning.
With a GPU (marker ``cuda``): the kernels against the CPU, for several shapes, all algorithms and input
dtypes, a grad_dim × batch > 2**31 case (marker ``slow`` too), determinism, fast_jl interop.

On the lent GPU machine: ``pip install ninja`` if missing, then
``python -m pytest -m cuda tests/cuda_ext/test_cuda_ext.py`` (see docs/gpu.md).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import types
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/cuda_ext/ is two folders down)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
try:
    import trak_core  # noqa: F401
except ImportError:  # a Python without the pipeline's dependencies (the GPU machine: no zarr, pydantic):
    _pkg = types.ModuleType("trak_core")  # load trak_core's pure-torch modules without its __init__
    _pkg.__path__ = [str(ROOT / "trak_core")]
    sys.modules["trak_core"] = _pkg

import cuda_ext  # noqa: E402
from cuda_ext import _build, torch_path  # noqa: E402
from cuda_ext.projectors import CudaDenseProjector, CudaFallbackWarning, CudaSJLTProjector  # noqa: E402
from trak_core.errors import BadInputError  # noqa: E402
from trak_core.projection import counter_rng  # noqa: E402
from trak_core.projection.projectors import DenseProjector  # noqa: E402

HERE = ROOT / "cuda_ext"
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _cpu_sjlt(grad_dim, proj_dim, seed, c):
    """The CPU SJLT projector of trak_core where this checkout has it, else the definition in float32."""
    try:
        from trak_core.projection.sjlt import SJLTProjector

        return SJLTProjector(grad_dim, proj_dim, seed, "rademacher", "cpu", c=c)
    except ImportError:
        return cuda_ext.projectors._ReferenceSJLTProjector(grad_dim, proj_dim, seed, "rademacher", c=c)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (the error relative to the output's scale)."""
    ref = ref.double().cpu()
    return float((out.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ====================================================================== no GPU needed
@pytest.fixture(scope="module")
def host_check(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    exe = tmp_path_factory.mktemp("hostcheck") / "hash_host_check"
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Werror",
            f"-I{HERE}",
            str(HERE / "hash_host_check.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
        text=True,
    )

    def run(lines: list[str]) -> list[str]:
        res = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
        return res.stdout.split("\n")[: len(lines)]

    return run


def _counters(n=2000, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    small = torch.arange(0, 64, dtype=torch.int64)
    edges = torch.tensor(
        [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 5, 2**40 + 12345, 2**62, 2**63 - 1], dtype=torch.int64
    )
    rand = torch.randint(0, 2**62, (n,), generator=g, dtype=torch.int64)
    return torch.cat([small, edges, rand])


def test_header_hash_and_keys_equal_python(host_check):
    keys = [0, 1, counter_rng.stream_key(0, 0, 1), counter_rng.stream_key(7, 2**33 + 1, 5), 0xFFFFFFFF]
    ctr = _counters()
    for key in keys:
        got = [int(v) for v in host_check([f"H {int(c)} {key}" for c in ctr])]
        assert got == counter_rng.hash_counter(ctr, key).tolist(), f"key={key}"
    cases = [(s, m, st) for s in (0, 1, 3, 2**32 + 7, 2**63 - 1) for m in (0, 1, 99, 2**40) for st in range(1, 7)]
    got = [int(v) for v in host_check([f"K {s} {m} {st}" for s, m, st in cases])]
    assert got == [counter_rng.stream_key(s, m, st) for s, m, st in cases]


def test_header_matrix_entries_equal_python(host_check):
    seed, mid = 5, 3
    # Rademacher: rows incl. beyond 2**32 / words (64-bit counters), ragged column counts
    for cols in (1, 31, 33, 70, 2047):
        key = counter_rng.stream_key(seed, mid, counter_rng.STREAM_SIGN_WORDS)
        for row0 in (0, 2**33 + 11):
            mat = counter_rng.rademacher_block(seed, mid, row0, row0 + 3, cols)
            qs = [(r, c) for r in range(3) for c in range(cols)]
            got = [int(v) for v in host_check([f"R {row0 + r} {c} {cols} {key}" for r, c in qs])]
            assert got == [int(mat[r, c]) for r, c in qs], (cols, row0)
    # normal: float32 Box–Muller; host libm vs torch differ by at most a few ulps
    k1 = counter_rng.stream_key(seed, mid, counter_rng.STREAM_NORMAL_U1)
    k2 = counter_rng.stream_key(seed, mid, counter_rng.STREAM_NORMAL_U2)
    cols = 257
    mat = counter_rng.normal_block(seed, mid, 1000, 1008, cols)
    got = torch.tensor(
        [float(v) for v in host_check([f"N {(1000 + r) * cols + c} {k1} {k2}" for r in range(8) for c in range(cols)])]
    ).reshape(8, cols)
    torch.testing.assert_close(got, mat, rtol=2e-6, atol=2e-6)
    # SJLT: columns and signs exactly
    for proj_dim, c in ((2048, 4), (1000, 1), (7, 3)):
        kr = counter_rng.stream_key(seed, mid, counter_rng.STREAM_SJLT_ROW)
        ks = counter_rng.stream_key(seed, mid, counter_rng.STREAM_SJLT_SIGN)
        for row0 in (0, 2**32 + 3):
            cols_, signs = counter_rng.sjlt_block(seed, mid, row0, row0 + 50, proj_dim, c)
            out = host_check([f"S {(row0 + i) * c + r} {kr} {ks} {proj_dim}" for i in range(50) for r in range(c)])
            got = torch.tensor([[int(t) for t in ln.split()] for ln in out])
            assert got[:, 0].tolist() == cols_.reshape(-1).tolist()
            assert (1 - 2 * got[:, 1]).tolist() == signs.reshape(-1).tolist()


def _nvcc_object(tmp_dir: Path, archs=(80, 90)) -> tuple[Path, str]:
    obj = tmp_dir / "kernels.o"
    cmd = ["nvcc", "-std=c++20", "-O3", "-Xcompiler", "-fPIC", "-Xptxas", "-v", f"-I{HERE}"]
    for a in archs:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    cmd += ["-c", str(HERE / "kernels.cu"), "-o", str(obj)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    return obj, res.stderr


@pytest.fixture(scope="module")
def kernels_object(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    return _nvcc_object(tmp_path_factory.mktemp("nvcc"))


@needs_nvcc
def test_kernel_source_compiles(kernels_object):
    """kernels.cu (pure CUDA, no torch headers) compiles for sm_80 and sm_90 with no register spills."""
    obj, log = kernels_object
    assert obj.stat().st_size > 0
    for arch in ("sm_80", "sm_90"):
        assert f"for '{arch}'" in log
    for name in ("dense_fma_kernel", "dense_tc_kernel", "sjlt_gather_kernel", "reduce_partial_kernel"):
        assert name in log
    spills, current = {}, None  # (kernel, arch) -> bytes of register spills
    for ln in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\d+)'", ln)
        if m:
            current = m.groups()
            continue
        m = re.search(r"(\d+) bytes spill stores", ln)
        if m and current:
            spills[current] = max(spills.get(current, 0), int(m.group(1)))
    # the hot kernels (tensor-core, Rademacher FMA, SJLT) keep everything in registers; the normal FMA
    # kernel may spill a few bytes in cosf's slow path (arguments beyond 2π never reach it)
    hot = {
        k: v
        for k, v in spills.items()
        if "dense_tc_kernel" in k[0] or "sjlt_gather" in k[0] or ("dense_fma_kernel" in k[0] and "Li0EE" in k[0])
    }
    assert len(hot) == 2 * (9 + 3 + 18), sorted(hot)
    assert not any(hot.values()), {k: v for k, v in hot.items() if v}


@needs_nvcc
@needs_gxx
def test_binding_compiles_links_and_imports(kernels_object, tmp_path):
    """binding.cpp compiles against this torch, links with the nvcc object and cudart, and imports (the
    module then reports the absence of a GPU instead of crashing)."""
    from torch.utils import cpp_extension

    homes = [
        cpp_extension.CUDA_HOME,
        os.environ.get("CUDA_HOME"),
        str(Path(shutil.which("nvcc")).resolve().parents[1]),
        "/usr/local/cuda",
    ]
    libs = [Path(h) / "lib64" for h in homes if h and (Path(h) / "lib64" / "libcudart.so").exists()]
    if not libs:
        pytest.skip(f"no libcudart.so under {homes}")
    cuda_lib = libs[0]
    obj, _ = kernels_object
    name = "trakflow_cuda_ext_linkcheck"
    so = tmp_path / f"{name}.so"
    inc = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f"-I{HERE}"]
    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [
        "g++",
        "-std=c++20",
        "-O1",
        "-fPIC",
        "-shared",
        f"-DTORCH_EXTENSION_NAME={name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *inc,
        str(HERE / "binding.cpp"),
        str(obj),
        "-o",
        str(so),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        f"-L{cuda_lib}",
        "-lcudart",
        f"-Wl,-rpath,{torch_lib}",
        f"-Wl,-rpath,{cuda_lib}",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.kernels_version() >= 1
    assert mod.ksplit_rows() == _build.KSPLIT
    if not HAS_CUDA:
        assert mod.device_cc() < 0  # a CUDA error code, not a crash
        with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
            mod.dense_project(torch.zeros(2, 3), torch.zeros(2, 4), 0, 1, 2, 0, 0, _build.KSPLIT, 1 << 20, 0)


def test_torch_path_equals_the_definition():
    for seed, mid, r0, r1, cols in ((3, 1, 5, 40, 70), (0, 2**33, 2**33, 2**33 + 4, 33), (9, 0, 0, 3, 1)):
        assert torch.equal(
            torch_path.rademacher_block(seed, mid, r0, r1, cols), counter_rng.rademacher_block(seed, mid, r0, r1, cols)
        )
        assert torch.equal(
            torch_path.normal_block(seed, mid, r0, r1, cols), counter_rng.normal_block(seed, mid, r0, r1, cols)
        )
        for c in (1, 4):
            got = torch_path.sjlt_entries(seed, mid, r0, r1, cols, c)
            want = counter_rng.sjlt_block(seed, mid, r0, r1, cols, c)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_counter_rng_device_argument_is_the_same_definition():
    """counter_rng is the only definition: ``device=`` names where it is computed, not what it computes."""
    for fn in (counter_rng.rademacher_block, counter_rng.normal_block):
        assert torch.equal(fn(3, 1, 5, 40, 70, device="cpu"), fn(3, 1, 5, 40, 70))
        assert torch.equal(fn(3, 1, 5, 40, 70, device=torch.device("cpu")), fn(3, 1, 5, 40, 70))
    a, b = counter_rng.sjlt_block(3, 1, 5, 40, 70, 4, device="cpu"), counter_rng.sjlt_block(3, 1, 5, 40, 70, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch_path.rademacher_block is counter_rng.rademacher_block  # one definition, re-exported
    assert torch_path.normal_block is counter_rng.normal_block
    assert torch.equal(torch_path.dense_block("normal", 3, 1, 5, 40, 70), counter_rng.normal_block(3, 1, 5, 40, 70))


@needs_cuda
def test_counter_rng_on_the_gpu_equals_the_cpu():
    """The integer part (signs, SJLT entries) is bit-identical on the GPU; normals as the device's libm rounds."""
    for seed, mid, r0, r1, cols in ((3, 1, 5, 400, 70), (0, 2**33, 2**33, 2**33 + 40, 2049)):
        assert torch.equal(
            counter_rng.rademacher_block(seed, mid, r0, r1, cols, device="cuda").cpu(),
            counter_rng.rademacher_block(seed, mid, r0, r1, cols),
        )
        got = counter_rng.sjlt_block(seed, mid, r0, r1, cols, 4, device="cuda")
        want = counter_rng.sjlt_block(seed, mid, r0, r1, cols, 4)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
        torch.testing.assert_close(
            counter_rng.normal_block(seed, mid, r0, r1, cols, device="cuda").cpu(),
            counter_rng.normal_block(seed, mid, r0, r1, cols),
            rtol=2e-6,
            atol=2e-6,
        )


def test_cuda_ext_registers_into_trak_core():
    """Importing cuda_ext registers the GPU projectors; trak_core finds them for CUDA devices only."""
    from trak_core.projection import projectors

    assert projectors.find_projector("dense", "cuda").factory is CudaDenseProjector
    assert projectors.find_projector("sjlt", "cuda:1").factory is CudaSJLTProjector
    assert projectors.find_projector("dense", "cpu").factory is DenseProjector
    assert "fast_jl" in projectors.registered_projectors("cuda")
    cuda_ext.register_projectors()  # idempotent


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=300)


def test_trak_core_never_imports_cuda_ext():
    """No import of cuda_ext in trak_core's source (function-local ones included), nor at run time on the CPU."""
    import ast

    for path in sorted((ROOT / "trak_core").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("cuda_ext"):
                names = [node.value]  # importlib.import_module("cuda_ext") and the like
            assert not [n for n in names if n.split(".")[0] == "cuda_ext"], f"{path.name}:{node.lineno} names cuda_ext"
    res = _run_python(
        "import sys, torch, trak_core\n"
        "from trak_core.projection.projectors import make_projector\n"
        "for k in ('dense', 'sjlt', 'noop'): make_projector(k, 100, 16)\n"
        "make_projector('factored', 15, 8, model=torch.nn.Linear(4, 3))\n"
        "assert 'cuda_ext' not in sys.modules, 'cuda_ext imported'\n"
    )
    assert res.returncode == 0, res.stderr[-2000:]


def _plugin_declared() -> bool:
    import importlib.metadata

    return any(e.name == "cuda_ext" for e in importlib.metadata.entry_points(group="trakflow.projectors"))


@pytest.mark.skipif(not _plugin_declared(), reason="trakflow is not installed (pip install -e .)")
def test_cuda_devices_load_the_plugin_through_its_entry_point():
    """A fresh process: make_projector(device='cuda') finds cuda_ext through the ``trakflow.projectors`` entry
    point (the installed package declares it), without anyone importing cuda_ext by name."""
    res = _run_python(
        "import sys, warnings, importlib.metadata as md\n"
        "assert any(e.name == 'cuda_ext' for e in md.entry_points(group='trakflow.projectors'))\n"
        "from trak_core.projection.projectors import make_projector\n"
        "assert 'cuda_ext' not in sys.modules\n"
        "warnings.simplefilter('ignore')\n"
        "p = make_projector('dense', 100, 16, device='cuda')\n"
        "assert type(p).__module__ == 'cuda_ext.projectors', type(p)\n"
        "print(type(p).__name__)\n"
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "CudaDenseProjector"


@pytest.mark.parametrize("kind", ["rademacher", "normal"])
def test_torch_backend_equals_cpu_projector(kind):
    g = torch.randn(9, 1500, generator=torch.Generator().manual_seed(1))
    p = CudaDenseProjector(1500, 300, seed=4, proj_type=kind, device="cpu", backend="torch")
    ref = DenseProjector(1500, 300, seed=4, proj_type=kind).project(g, model_id=2)
    assert _rel_err(p.project(g, model_id=2), ref) < 1e-6
    d = {"w": g[:, :1000].reshape(9, 10, 100), "b": g[:, 1000:]}
    assert _rel_err(p.project(d, model_id=2), ref) < 1e-6


@pytest.mark.parametrize("c", [1, 3, 4])
def test_sjlt_plan_and_torch_backend_equal_the_definition(c):
    grad_dim, proj_dim = 3000, 257
    g = torch.randn(6, grad_dim, generator=torch.Generator().manual_seed(2))
    exact = torch_path.sjlt_reference(g, 11, 5, proj_dim, c)  # float64
    cpu = _cpu_sjlt(grad_dim, proj_dim, 11, c).project(g, model_id=5)
    col_ptr, packed = torch_path.sjlt_plan(11, 5, grad_dim, proj_dim, c, chunk_rows=1000)
    assert int(col_ptr[-1]) == grad_dim * c and packed.numel() == grad_dim * c
    coords = packed >> 1
    for j in (0, 100, proj_dim - 1):  # coordinates of a column are visited in increasing order
        seg = coords[col_ptr[j] : col_ptr[j + 1]]
        assert torch.all(seg[1:] >= seg[:-1])
    plan_out = torch_path.sjlt_project_from_plan(g, col_ptr, packed, proj_dim, math.sqrt(proj_dim / c))
    torch_out = CudaSJLTProjector(grad_dim, proj_dim, 11, device="cpu", c=c, backend="torch").project(g, 5)
    for out in (cpu, plan_out, torch_out):
        assert _rel_err(out, exact) < 1e-6


def test_fallback_without_cuda_is_one_line_and_cpu_exact():
    if HAS_CUDA:
        pytest.skip("this machine has CUDA")
    g = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        p = CudaDenseProjector(1000, 256, seed=3, device="cuda")
    msgs = [str(w.message) for w in rec if issubclass(w.category, CudaFallbackWarning)]
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert "CPU DenseProjector" in msgs[0] and _build.cuda_unavailable_reason() in msgs[0]
    assert p.backend == "cpu" and p.fallback_reason
    assert torch.equal(p.project(g, 1), DenseProjector(1000, 256, seed=3).project(g, 1))
    assert p.spec() == DenseProjector(1000, 256, seed=3).spec()
    with pytest.warns(CudaFallbackWarning, match="SJLTProjector"):
        s = CudaSJLTProjector(1000, 256, seed=3, device="cuda", c=4)
    assert torch.equal(s.project(g, 1), _cpu_sjlt(1000, 256, 3, 4).project(g, 1))
    assert s.spec()["kind"] == "sjlt" and s.spec()["c"] == 4
    assert cuda_ext.load_extension() is None and cuda_ext.unavailable_reason()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        CudaDenseProjector(1000, 256, device="cuda", backend="kernel")


def test_bad_arguments_are_refused():
    from trak_core.errors import BadInputError

    with pytest.raises(BadInputError, match="algo"):
        CudaDenseProjector(10, 5, device="cpu", algo="fast")
    with pytest.raises(BadInputError, match="tensor cores"):
        CudaDenseProjector(10, 5, proj_type="normal", device="cpu", algo="tc3")
    with pytest.raises(BadInputError, match="proj_type"):
        CudaSJLTProjector(10, 5, proj_type="normal", device="cpu")
    with pytest.raises(BadInputError, match="c "):
        CudaSJLTProjector(10, 5, device="cpu", c=0)
    with pytest.raises(BadInputError, match="grad_dim"):
        CudaDenseProjector(10, 5, device="cpu").project(torch.zeros(2, 11), 0)
    with pytest.raises(BadInputError, match="unknown GPU projector"):
        cuda_ext.make_cuda_projector("fancy", 10, 5)


def test_make_projector_routes_cuda_devices_here():
    """trak_core.make_projector(kind in (dense, sjlt), device='cuda...') builds our GPU projectors (which fall
    back to the CPU ones where there is no CUDA); other devices keep trak_core's projectors."""
    from trak_core.projection.projectors import make_projector

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaFallbackWarning)
        p = make_projector("dense", 100, 32, seed=1, device="cuda")
        s = make_projector("sjlt", 100, 32, seed=1, device="cuda", c=2)
    assert isinstance(p, CudaDenseProjector) and isinstance(s, CudaSJLTProjector) and s.c == 2
    assert p.spec() == make_projector("dense", 100, 32, seed=1).spec()
    assert type(make_projector("dense", 100, 32, device="cpu")) is DenseProjector


def test_fast_jl_is_optional_with_a_clear_error():
    if importlib.util.find_spec("fast_jl") is not None:
        pytest.skip("fast_jl is installed here")
    with pytest.raises(ModuleNotFoundError, match="pip install fast_jl --no-build-isolation"):
        cuda_ext.make_cuda_projector("fast_jl", 1000, 512, device="cuda")


# ---------------------------------------------------------------------- the kernels' self-check (CPU)

from cuda_ext import selfcheck  # noqa: E402
from cuda_ext.projectors import CudaBackendError, CudaSelfCheckWarning  # noqa: E402


@pytest.fixture
def fresh_self_check():
    """An empty cache of self-check decisions before and after the test."""
    selfcheck.clear_cache()
    yield selfcheck
    selfcheck.clear_cache()


def _dense_ref(kind="rademacher", seed=3, mid=2, proj_dim=16):
    return lambda x: torch_path.dense_project(x, kind, seed, mid, proj_dim, dtype=torch.float64)


def _dense_f32(kind="rademacher", seed=3, mid=2, proj_dim=16):
    """A correct candidate with float32 accumulation in another order than the reference's."""
    return lambda x: torch_path.dense_project(x, kind, seed, mid, proj_dim, block_elems=1 << 12)


def _self_check_warnings(rec) -> list[str]:
    return [str(w.message) for w in rec if issubclass(w.category, CudaSelfCheckWarning)]


def test_self_check_probes_cross_the_kernels_block_boundaries():
    probes = selfcheck.make_probes("cpu", 1e-4)
    assert [p.name for p in probes] == ["integer", "float"]
    rows, cols = probes[0].x.shape
    assert rows > 32 and cols > 2 * _build.KSPLIT and cols % 32 and cols % 64  # batch tile, split-K, k-steps
    assert probes[0].x.dtype == torch.float32 and probes[0].x.abs().max() <= selfcheck.PROBE_INT_MAX
    assert selfcheck.PROBE_INT_MAX * cols < 2**24  # every partial sum of the integer probe is exact in float32
    assert [p.name for p in selfcheck.make_probes("cpu", 1e-4, exact=False)] == ["float"]
    assert torch.equal(selfcheck.make_probes("cpu", 1e-4)[1].x, probes[1].x)  # fixed inputs


@pytest.mark.parametrize("kind", ["rademacher", "normal"])
def test_self_check_passes_a_correct_float32_candidate(kind):
    """Another float32 accumulation order is no mismatch: the integer probe is exact in any order, the float
    probe's error (~1e-6) is far below the tolerance."""
    probes = selfcheck.make_probes("cpu", selfcheck.TOLERANCE["fma"], exact=kind == "rademacher")
    assert selfcheck.self_check(_dense_f32(kind), _dense_ref(kind), probes) is None


def test_self_check_passes_the_sjlt_gather_emulation():
    proj_dim, c = 40, 3
    probes = selfcheck.make_probes("cpu", selfcheck.TOLERANCE["sjlt"])
    col_ptr, packed = torch_path.sjlt_plan(3, 2, probes[0].x.shape[1], proj_dim, c)
    scale = math.sqrt(proj_dim / c)
    cand = lambda x: torch_path.sjlt_project_from_plan(x, col_ptr, packed, proj_dim, scale)  # noqa: E731
    ref = lambda x: torch_path.sjlt_reference(x, 3, 2, proj_dim, c)  # noqa: E731
    assert selfcheck.self_check(cand, ref, probes) is None
    bad = packed.clone()
    bad[int(col_ptr[5])] ^= 1  # one flipped sign in column 5
    wrong = lambda x: torch_path.sjlt_project_from_plan(x, col_ptr, bad, proj_dim, scale)  # noqa: E731
    reason = selfcheck.self_check(wrong, ref, probes)
    assert reason is not None and "differ from the exact result" in reason and "integer input" in reason


def _flip_one_sign(candidate, row=40000, col=5):
    """The candidate with the matrix entry (row, col) negated: a one-entry kernel bug in the second split."""

    def wrong(x):
        out = candidate(x).clone()
        r = torch_path.dense_block("rademacher", 3, 2, row, row + 1, 16)[0, col]
        out[:, col] -= 2 * x[:, row] * r
        return out

    return wrong


def test_self_check_names_each_kind_of_failure():
    small = selfcheck.make_probes("cpu", 1e-4, rows=5, cols=300)
    ref, good = _dense_ref(), _dense_f32()
    assert selfcheck.self_check(good, ref, small) is None
    # one wrong sign: the exact integer probe sees it
    reason = selfcheck.self_check(_flip_one_sign(good), ref, selfcheck.make_probes("cpu", 1e-4))
    assert re.fullmatch(
        r"\d+ of \d+ entries differ from the exact result \(max \|diff\| [\d.e+-]+\) "
        r"on a 33×70001 integer input",
        reason,
    ), reason
    # a small numerical error (float probe only: a normal matrix has no exact probe)
    nudged = lambda x: good(x) * (1 + 3e-4)  # noqa: E731
    reason = selfcheck.self_check(nudged, ref, selfcheck.make_probes("cpu", 1e-4, exact=False, rows=5, cols=300))
    assert re.fullmatch(r"max rel err 3\.0e-04 > 1e-04 on a 5×300 float input", reason), reason
    assert "integer input" in selfcheck.self_check(nudged, ref, small)  # the exact probe catches it first
    # dropped last split (coordinates ≥ 2 × 32768)
    dropped = lambda x: good(torch.cat([x[:, : 2 * _build.KSPLIT], 0 * x[:, 2 * _build.KSPLIT :]], 1))  # noqa: E731
    assert "differ" in selfcheck.self_check(dropped, ref, selfcheck.make_probes("cpu", 1e-4))
    # non-finite, wrong shape, exceptions on either side
    nan = lambda x: good(x) * float("nan")  # noqa: E731
    assert selfcheck.self_check(nan, ref, small) == "80 non-finite outputs on a 5×300 integer input"
    assert "returned shape (5, 15), expected (5, 16)" in selfcheck.self_check(lambda x: good(x)[:, :15], ref, small)

    def boom(x):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")

    reason = selfcheck.self_check(boom, ref, small)
    assert reason == (
        "the kernel raised RuntimeError: CUDA error: an illegal memory access was encountered "
        "CUDA kernel errors ... on a 5×300 integer input"
    )
    assert selfcheck.self_check(good, boom, small).startswith("the reference (torch path) raised RuntimeError")


def test_checked_once_warns_once_and_caches_per_process_device_class_algo(fresh_self_check):
    calls = []

    def failing():
        calls.append(1)
        return "max rel err 3e-02 > 1e-04 on a 33×70001 float input"

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            assert selfcheck.checked_once("CudaDenseProjector", "cuda:0", "algo=tc3, rademacher", failing)
        assert selfcheck.checked_once("CudaDenseProjector", "cuda:1", "algo=tc3, rademacher", failing)
        assert selfcheck.checked_once("CudaDenseProjector", "cuda:0", "algo=fma, rademacher", lambda: None) is None
        assert selfcheck.checked_once("CudaDenseProjector", "cuda:0", "algo=fma, rademacher", failing) is None

        def raising():
            raise MemoryError("out of memory")

        assert (
            selfcheck.checked_once("CudaSJLTProjector", "cuda:0", "gather", raising)
            == "the check raised MemoryError: out of memory"
        )
    assert len(calls) == 2  # once per (device, class, algo)
    msgs = _self_check_warnings(rec)
    assert msgs == [
        "cuda_ext: CudaDenseProjector (algo=tc3, rademacher) failed its self-check (max rel err 3e-02 > 1e-04 on "
        "a 33×70001 float input); using the torch path",
        "cuda_ext: CudaDenseProjector (algo=tc3, rademacher) failed its self-check (max rel err 3e-02 > 1e-04 on "
        "a 33×70001 float input); using the torch path",
        "cuda_ext: CudaSJLTProjector (gather) failed its self-check (the check raised MemoryError: out of memory); "
        "using the torch path",
    ]
    assert issubclass(CudaSelfCheckWarning, CudaFallbackWarning)


def _as_kernel_backend(p, monkeypatch):
    """Make a CPU-built projector behave as if its kernels had built (the kernel itself is monkeypatched)."""
    monkeypatch.setattr(p, "backend", "kernel")
    return p


def test_a_wrong_dense_kernel_falls_back_to_the_torch_path(fresh_self_check, monkeypatch):
    """A deliberately wrong kernel (one sign) on first use: the torch path, one warning line, and the decision
    is cached: a second projector neither re-runs the wrong kernel nor warns again."""
    calls = []

    def wrong_kernel(self, pieces, model_id, out):
        calls.append(pieces[0].shape)
        x = torch.cat(pieces, 1)
        out += torch_path.dense_project(x, "rademacher", self.seed, model_id, self.proj_dim)
        out[:, 3] = -out[:, 3]
        return out

    monkeypatch.setattr(CudaDenseProjector, "_kernel_project", wrong_kernel)
    g = torch.randn(6, 1000, generator=torch.Generator().manual_seed(4))
    want = DenseProjector(1000, 16, seed=3).project(g, 2)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        p = _as_kernel_backend(
            CudaDenseProjector(1000, 16, seed=3, device="cpu", backend="torch", algo="fma"), monkeypatch
        )
        out = p.project(g, model_id=2)
        assert p.backend == "torch" and p.fallback_reason.startswith("failed its self-check (")
        assert torch.equal(out, want) or _rel_err(out, want) < 1e-6
        assert len(calls) == 1 and tuple(calls[0]) == (33, 70001)  # the probe, not the user's batch
        q = _as_kernel_backend(
            CudaDenseProjector(1000, 16, seed=9, device="cpu", backend="torch", algo="fma"), monkeypatch
        )
        assert _rel_err(q.project(g, model_id=0), DenseProjector(1000, 16, seed=9).project(g, 0)) < 1e-6
        assert q.backend == "torch" and len(calls) == 1  # cached: not checked again
        p.project(g, model_id=2)
        assert len(calls) == 1
    msgs = _self_check_warnings(rec)
    assert len(msgs) == 1 and "\n" not in msgs[0], msgs
    assert re.fullmatch(
        r"cuda_ext: CudaDenseProjector \(algo=fma, rademacher\) failed its self-check \(\d+ of "
        r"\d+ entries differ from the exact result \(max \|diff\| [\d.e+-]+\) on a 33×70001 "
        r"integer input\); using the torch path",
        msgs[0],
    ), msgs[0]
    # another algorithm is another kernel: checked (and here failing) on its own
    with pytest.warns(CudaSelfCheckWarning, match=r"\(algo=tc3, rademacher\)"):
        _as_kernel_backend(
            CudaDenseProjector(1000, 16, seed=3, device="cpu", backend="torch", algo="tc3"), monkeypatch
        ).project(g, 2)
    assert len(calls) == 2


def test_a_correct_dense_kernel_passes_and_is_used(fresh_self_check, monkeypatch):
    used = []

    def kernel(self, pieces, model_id, out):  # right, with float32 accumulation in its own order
        used.append(tuple(pieces[0].shape))
        offset = 0
        for piece in pieces:
            torch_path.dense_project(
                piece,
                self.proj_type.value,
                self.seed,
                model_id,
                self.proj_dim,
                row0=offset,
                out=out,
                block_elems=1 << 12,
            )
            offset += piece.shape[1]
        return out

    monkeypatch.setattr(CudaDenseProjector, "_kernel_project", kernel)
    g = torch.randn(6, 1000, generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaSelfCheckWarning)
        for kind in ("rademacher", "normal"):
            p = _as_kernel_backend(
                CudaDenseProjector(1000, 16, seed=3, proj_type=kind, device="cpu", backend="torch", algo="fma"),
                monkeypatch,
            )
            out = p.project(g, model_id=2)
            assert p.backend == "kernel" and p.fallback_reason is None
            assert _rel_err(out, DenseProjector(1000, 16, seed=3, proj_type=kind).project(g, 2)) < 1e-6
    # per kind: the probe (33×70001, twice for Rademacher, once for normal), then the batches
    assert used == [(33, 70001), (33, 70001), (6, 1000), (33, 70001), (6, 1000)]


def test_a_raising_kernel_falls_back_and_backend_kernel_raises(fresh_self_check, monkeypatch):
    def crashing(self, *args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(CudaDenseProjector, "_kernel_project", crashing)
    g = torch.randn(3, 500, generator=torch.Generator().manual_seed(5))
    with pytest.warns(
        CudaSelfCheckWarning,
        match=r"failed its self-check \(the kernel raised RuntimeError: CUDA "
        r"error: an illegal memory access was encountered on a 33×70001 "
        r"integer input\); using the torch path",
    ):
        p = _as_kernel_backend(
            CudaDenseProjector(500, 8, seed=1, device="cpu", backend="torch", algo="fma"), monkeypatch
        )
        out = p.project(g, 0)
    assert p.backend == "torch" and _rel_err(out, DenseProjector(500, 8, seed=1).project(g, 0)) < 1e-6
    # backend="kernel" asked for explicitly: an error instead of the fallback (from the cached decision)
    k = _as_kernel_backend(CudaDenseProjector(500, 8, seed=1, device="cpu", backend="torch", algo="fma"), monkeypatch)
    monkeypatch.setattr(k, "requested_backend", "kernel")
    with pytest.raises(CudaBackendError, match="backend='kernel' failed its self-check: the kernel raised") as ei:
        k.project(g, 0)
    assert isinstance(ei.value, RuntimeError) and isinstance(ei.value, BadInputError)


def test_a_wrong_sjlt_kernel_falls_back_to_the_torch_path(fresh_self_check, monkeypatch):
    def wrong_gather(self, x, col_ptr, packed):
        bad = packed.clone()
        bad[-1] ^= 1  # the last entry of the last column: one flipped sign
        return torch_path.sjlt_project_from_plan(x, col_ptr, bad, self.proj_dim, self.value_scale)

    def right_gather(self, x, col_ptr, packed):
        return torch_path.sjlt_project_from_plan(x, col_ptr, packed, self.proj_dim, self.value_scale)

    g = torch.randn(4, 800, generator=torch.Generator().manual_seed(6))
    want = torch_path.sjlt_reference(g, 2, 1, 32, 2)
    monkeypatch.setattr(CudaSJLTProjector, "_kernel_gather", right_gather)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaSelfCheckWarning)
        s = _as_kernel_backend(CudaSJLTProjector(800, 32, seed=2, device="cpu", c=2, backend="torch"), monkeypatch)
        assert _rel_err(s.project(g, 1), want) < 1e-6 and s.backend == "kernel"
    selfcheck.clear_cache()
    monkeypatch.setattr(CudaSJLTProjector, "_kernel_gather", wrong_gather)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        s = _as_kernel_backend(CudaSJLTProjector(800, 32, seed=2, device="cpu", c=2, backend="torch"), monkeypatch)
        out = s.project(g, 1)
        _as_kernel_backend(CudaSJLTProjector(800, 32, seed=5, device="cpu", c=4, backend="torch"), monkeypatch).project(
            g, 1
        )
    msgs = _self_check_warnings(rec)
    assert len(msgs) == 1 and msgs[0].startswith("cuda_ext: CudaSJLTProjector (gather) failed its self-check ("), msgs
    assert s.backend == "torch" and _rel_err(out, want) < 1e-6


# ====================================================================== GPU
cuda = pytest.mark.cuda

DENSE_SHAPES = [  # (grad_dim, proj_dim, batch): ragged tiles, split-K (> 32768 rows), batch tiles
    (1000, 1000, 1),
    (4097, 2047, 7),
    (70001, 512, 33),
    (33000, 100, 100),
    (300, 4096, 32),
]
# Tolerances on max|out - exact| / max|exact|, measured on an H100 (docs/gpu.md, "Measured on one H100"):
# * fma sums up to 32,768 float32 products in sequence per split, so its error grows like u·√K
#   (u = 2**-24); measured 1e-6 (K = 1,000) to 7.9e-6 (K = 33,000), CPU BLAS 4e-7. Bound: 2·u·√K.
# * the tensor-core paths accumulate in the mma units' float32, which does not round to nearest: the
#   error grows with K whatever the number of bf16 input terms (tc3 5.5e-5 and tc2 5.0e-5 at K = 33,000);
#   their bound is the self-check's 1e-4. One flipped sign gives ~3e-3; tc1's bf16 input 1.7e-3.
TOL = {"fma": None, "tc3": 1e-4, "tc2": 1e-4, "tc1": 1e-2}


def _tol(algo: str, grad_dim: int) -> float:
    """The test tolerance of an algorithm for a projection over ``grad_dim`` coordinates."""
    return TOL[algo] or 2 * 2**-24 * math.sqrt(grad_dim)


@pytest.fixture(scope="module")
def ext():
    e = _build.load_extension()
    if e is None:
        pytest.fail(f"the CUDA kernels did not build: {_build.unavailable_reason()}")
    return e


def _x(batch, grad_dim, seed=0, device="cuda", dtype=torch.float32):
    return torch.randn(batch, grad_dim, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _exact_dense(x, kind, seed, mid, proj_dim):
    """float64 x @ R with R from trak_core (CPU): the reference the float32 paths are measured against."""
    p = DenseProjector(x.shape[1], proj_dim, seed=seed, proj_type=kind)
    return x.double().cpu() @ p.matrix(mid).double()


@cuda
@needs_cuda
def test_device_hash_equals_python(ext):
    ctr = _counters(100000, seed=7)
    for key in (0, counter_rng.stream_key(3, 2**33 + 1, 1), 0xFFFFFFFF):
        got = ext.hash_words(ctr.cuda(), key, torch.cuda.current_stream().cuda_stream).cpu()
        assert torch.equal(got, counter_rng.hash_counter(ctr, key))


@cuda
@needs_cuda
@pytest.mark.parametrize("kind", ["rademacher", "normal"])
def test_device_matrix_equals_cpu_definition(ext, kind):
    for row0, rows, cols in ((0, 64, 2047), (2**33 + 3, 5, 100), (12345, 300, 33)):
        p = CudaDenseProjector(10, cols, seed=6, proj_type=kind)
        got = p.generate(4, row0, row0 + rows).cpu()
        want = (
            counter_rng.rademacher_block(6, 4, row0, row0 + rows, cols)
            if kind == "rademacher"
            else counter_rng.normal_block(6, 4, row0, row0 + rows, cols)
        )
        if kind == "rademacher":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@cuda
@needs_cuda
@pytest.mark.parametrize("algo", ["fma", "tc3", "tc2", "tc1"])
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dense_rademacher_equals_cpu(ext, algo, shape):
    grad_dim, proj_dim, batch = shape
    if algo.startswith("tc") and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tensor-core path needs sm_80+")
    x = _x(batch, grad_dim, seed=grad_dim)
    p = CudaDenseProjector(grad_dim, proj_dim, seed=1, proj_type="rademacher", algo=algo)
    assert p.backend == "kernel" and p.algo == algo
    out = p.project(x, model_id=3)
    assert out.shape == (batch, proj_dim) and out.dtype == torch.float32 and out.is_cuda
    exact = _exact_dense(x, "rademacher", 1, 3, proj_dim)
    cpu = DenseProjector(grad_dim, proj_dim, seed=1).project(x.cpu(), model_id=3)
    assert _rel_err(cpu, exact) < 2e-6  # the CPU's own float32 error, for scale
    assert _rel_err(out, exact) < _tol(algo, grad_dim), (algo, _rel_err(out, exact))
    assert torch.equal(p.project(x, model_id=3), out)  # deterministic


@cuda
@needs_cuda
@pytest.mark.parametrize("shape", DENSE_SHAPES[:4], ids=lambda s: "x".join(map(str, s)))
def test_dense_normal_equals_cpu(ext, shape):
    grad_dim, proj_dim, batch = shape
    x = _x(batch, grad_dim, seed=grad_dim + 1)
    p = CudaDenseProjector(grad_dim, proj_dim, seed=2, proj_type="normal")
    assert p.algo == "fma"
    out = p.project(x, model_id=1)
    assert _rel_err(out, _exact_dense(x, "normal", 2, 1, proj_dim)) < _tol("fma", grad_dim)
    assert torch.equal(p.project(x, model_id=1), out)


@cuda
@needs_cuda
@pytest.mark.parametrize("algo", ["fma", "tc3"])
def test_dense_rows_do_not_depend_on_the_batch(ext, algo):
    """Each example's vector is bit-identical in any batch (split-K is fixed, rows are independent)."""
    if algo == "tc3" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tensor-core path needs sm_80+")
    x = _x(70, 40000, seed=5)
    p = CudaDenseProjector(40000, 1000, seed=3, algo=algo)
    whole = p.project(x, model_id=0)
    parts = torch.cat([p.project(x[a:b], model_id=0) for a, b in ((0, 1), (1, 17), (17, 50), (50, 70))])
    assert torch.equal(parts, whole)
    small = CudaDenseProjector(40000, 1000, seed=3, algo=algo, max_partial_bytes=1)  # batch chunks of 32 rows
    assert torch.equal(small.project(x, model_id=0), whole)


@cuda
@needs_cuda
def test_dense_dict_and_dtypes(ext):
    x = _x(6, 5000, seed=9)
    p = CudaDenseProjector(5000, 640, seed=0)
    flat = p.project(x, model_id=2)
    d = {"a": x[:, :3000].reshape(6, 30, 100), "b": x[:, 3000:4999], "c": x[:, 4999]}
    torch.testing.assert_close(p.project(d, model_id=2), flat, rtol=1e-5, atol=1e-4)
    exact = _exact_dense(x, "rademacher", 0, 2, 640)
    tol = _tol(p.algo, 5000)
    grouped = CudaDenseProjector(5000, 640, seed=0, group_cols=1000)  # one kernel call per parameter
    assert _rel_err(grouped.project(d, model_id=2), exact) < tol  # its own sums: equal up to rounding
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        xd = x.to(dt)
        ref = _exact_dense(xd.float(), "rademacher", 0, 2, 640)
        assert _rel_err(p.project(xd, model_id=2), ref) < tol, dt
    assert _rel_err(p.project(x.cpu(), model_id=2), exact) < tol


@cuda
@needs_cuda
@pytest.mark.parametrize("batch", [1, 7, 33, 100])
@pytest.mark.parametrize("c", [1, 4])
def test_sjlt_equals_cpu(ext, batch, c):
    grad_dim, proj_dim = 50001, 1000
    x = _x(batch, grad_dim, seed=batch)
    p = CudaSJLTProjector(grad_dim, proj_dim, seed=7, c=c)
    assert p.backend == "kernel"
    out = p.project(x, model_id=2)
    exact = torch_path.sjlt_reference(x.cpu(), 7, 2, proj_dim, c)
    assert _rel_err(out, exact) < 2e-6
    assert _rel_err(_cpu_sjlt(grad_dim, proj_dim, 7, c).project(x.cpu(), 2), exact) < 2e-6
    assert torch.equal(p.project(x, model_id=2), out)
    assert (
        _rel_err(p.project(x.half(), model_id=2), torch_path.sjlt_reference(x.half().float().cpu(), 7, 2, proj_dim, c))
        < 2e-6
    )


@cuda
@needs_cuda
def test_fallback_to_torch_path_when_kernels_are_disabled(ext, monkeypatch):
    x = _x(5, 3000, seed=1)
    kernel = CudaDenseProjector(3000, 300, seed=1)
    exact = _exact_dense(x, "rademacher", 1, 0, 300)
    assert _rel_err(kernel.project(x, 0), exact) < _tol(kernel.algo, 3000)
    monkeypatch.setenv("TRAKFLOW_CUDA_EXT", "0")
    try:
        _build.load_extension(force=True)
        with pytest.warns(CudaFallbackWarning, match="pure-torch GPU path.*TRAKFLOW_CUDA_EXT=0"):
            p = CudaDenseProjector(3000, 300, seed=1)
        assert p.backend == "torch"
        out = p.project(x, 0)
        assert out.is_cuda and _rel_err(out, exact) < 2e-6  # cuBLAS float32 (TF32 off)
        with pytest.warns(CudaFallbackWarning):
            s = CudaSJLTProjector(3000, 300, seed=1, c=2)
        assert _rel_err(s.project(x, 0), torch_path.sjlt_reference(x.cpu(), 1, 0, 300, 2)) < 2e-6
    finally:
        monkeypatch.delenv("TRAKFLOW_CUDA_EXT")
        assert _build.load_extension(force=True) is not None


@cuda
@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("what", ["fma", "tc3", "normal", "sjlt"])
def test_grad_dim_times_batch_above_2_31(ext, what):
    """B·K > 2**31 (32 × 70M, float16 inputs: 4.5 GB): 64-bit indexing of x, of the matrix rows, of the plan.

    A sparse x (a few nonzeros, some at flat positions beyond 2**31) makes the exact answer cheap on the CPU.
    """
    if what == "tc3" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tensor-core path needs sm_80+")
    batch, grad_dim, proj_dim = 32, 70_000_000, 2048
    assert batch * grad_dim > 2**31
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip("needs 12 GB of free GPU memory")
    x = torch.zeros(batch, grad_dim, dtype=torch.float16, device="cuda")
    spots = [
        (0, 0, 1.0),
        (0, grad_dim - 1, -2.0),
        (31, grad_dim - 1, 0.5),
        (31, 12345, 3.0),
        (17, 2**26 + 7, -1.5),
        (30, grad_dim // 2, 2.5),
    ]
    assert any(b * grad_dim + i > 2**31 for b, i, _ in spots)
    for b, i, v in spots:
        x[b, i] = v
    exact = torch.zeros(batch, proj_dim, dtype=torch.float64)
    for b, i, v in spots:
        if what == "sjlt":
            row = torch_path.sjlt_reference(torch.ones(1, 1), 1, 0, proj_dim, 2, row0=i)[0]
        elif what == "normal":
            row = counter_rng.normal_block(1, 0, i, i + 1, proj_dim)[0].double()
        else:
            row = counter_rng.rademacher_block(1, 0, i, i + 1, proj_dim)[0].double()
        exact[b] += v * row
    if what == "sjlt":
        p = CudaSJLTProjector(grad_dim, proj_dim, seed=1, c=2)
    else:
        p = CudaDenseProjector(
            grad_dim,
            proj_dim,
            seed=1,
            proj_type="normal" if what == "normal" else "rademacher",
            algo="fma" if what == "normal" else what,
        )
    out = p.project(x, model_id=0)
    assert _rel_err(out, exact) < 2e-6
    if what in ("fma", "tc3"):  # and a dense x against the torch path (same matrix, generated by torch ops)
        xd = torch.randn(batch, grad_dim, dtype=torch.float16, device="cuda")
        small = CudaDenseProjector(grad_dim, 64, seed=1, algo=what)
        ref = torch_path.dense_project(xd, "rademacher", 1, 0, 64)
        assert _rel_err(small.project(xd, model_id=0), ref) < 2e-5


@cuda
@needs_cuda
def test_fast_jl_interop():
    if importlib.util.find_spec("fast_jl") is None:
        pytest.skip("fast_jl is not installed")
    from cuda_ext.fast_jl_interop import FastJLProjector

    for batch, proj_dim in ((5, 1000), (40, 512), (33, 2048)):
        x = _x(batch, 20000, seed=batch)
        p = FastJLProjector(20000, proj_dim, seed=0)
        out = p.project(x, model_id=1)
        assert out.shape == (batch, proj_dim)
        ip = (out.double() @ out.double().T) / proj_dim
        ref = x.double() @ x.double().T
        norms = ref.diagonal().sqrt()
        assert float(((ip - ref) / (norms[:, None] * norms[None, :])).abs().max()) < 6 / math.sqrt(proj_dim)
        assert torch.equal(p.project(x, model_id=1), out)


@cuda
@needs_cuda
@pytest.mark.parametrize("what", ["fma", "tc3", "tc2", "tc1", "normal", "sjlt"])
def test_real_kernels_pass_their_self_check(ext, what, fresh_self_check):
    """On the GPU: each real kernel passes its first-use self-check (no warning, the kernel backend kept),
    the decision is cached, and a re-run of the check on other parameters passes too."""
    if what.startswith("tc") and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tensor-core path needs sm_80+")
    x = _x(5, 3000, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaSelfCheckWarning)
        if what == "sjlt":
            p = CudaSJLTProjector(3000, 1000, seed=4, c=4)
        else:
            p = CudaDenseProjector(
                3000,
                1000,
                seed=4,
                proj_type="normal" if what == "normal" else "rademacher",
                algo="fma" if what == "normal" else what,
            )
        p.project(x, model_id=1)
    assert p.backend == "kernel" and p.fallback_reason is None
    assert list(selfcheck._decisions.values()) == [None]
    other = (
        CudaSJLTProjector(3000, 2047, seed=2**40, c=1)
        if what == "sjlt"
        else CudaDenseProjector(3000, 31, seed=2**40, proj_type=p.proj_type, algo=p.algo)
    )
    assert other._self_check(model_id=2**33 + 1) is None


@cuda
@needs_cuda
def test_a_wrong_kernel_on_the_gpu_falls_back_to_the_gpu_torch_path(ext, fresh_self_check, monkeypatch):
    real = CudaDenseProjector._kernel_project

    def off_by_one_split(self, pieces, model_id, out):  # drops everything after the first split
        return real(self, [p[:, : _build.KSPLIT] for p in pieces], model_id, out)

    monkeypatch.setattr(CudaDenseProjector, "_kernel_project", off_by_one_split)
    x = _x(5, 3000, seed=2)
    with pytest.warns(CudaSelfCheckWarning, match="failed its self-check .*33×70001 integer input"):
        p = CudaDenseProjector(3000, 300, seed=1, algo="fma")
        out = p.project(x, 0)
    assert p.backend == "torch" and out.is_cuda
    assert _rel_err(out, _exact_dense(x, "rademacher", 1, 0, 300)) < 2e-6
