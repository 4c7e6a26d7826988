"""One contract, checked against every projector and every model output (scikit-learn's check_estimator):
the checks live in trak_core.testing, so a user's own projector or model output runs the same suite."""

import numpy as np
import pytest
import torch
from trak_fixtures import make_data, make_model

from trak_core.compat.projectors import BasicProjector, BasicSingleBlockProjector
from trak_core.errors import BadInputError
from trak_core.featurize.modelout import (
    CLIPModelOutput,
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
)
from trak_core.projection import counter_rng
from trak_core.projection.factored import FactoredProjector
from trak_core.projection.projectors import (
    AbstractProjector,
    DenseProjector,
    NoOpProjector,
    find_projector,
    make_projector,
    register_projector,
    registered_projectors,
    unregister_projector,
)
from trak_core.projection.sjlt import SJLTProjector
from trak_core.testing import (
    ModelOutputCase,
    ProjectorCase,
    check_model_output,
    check_projector,
    check_projector_batch_split,
    check_projector_inner_products,
    check_projector_refuses_bad_input,
    iter_checks,
    parametrize_with_checks,
)

GRAD_DIM, PROJ_DIM = 1000, 256
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _mlp():
    # Linear(20, 30) + LayerNorm(30) (the dense "__other__" block) + Linear(30, 10): 630 + 60 + 310 = 1000
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.LayerNorm(30), torch.nn.Linear(30, 10))


def _cuda(cls_name, **kw):
    def factory(seed=3):
        from cuda_ext import projectors  # the GPU plugin (imported by the tests that use it, never by trak_core)

        return getattr(projectors, cls_name)(GRAD_DIM, PROJ_DIM, seed=seed, **kw)

    return factory


PROJECTORS = [
    ProjectorCase(
        lambda seed=3: DenseProjector(GRAD_DIM, PROJ_DIM, seed=seed, proj_type="rademacher"), id="dense-rademacher"
    ),
    ProjectorCase(lambda seed=3: DenseProjector(GRAD_DIM, PROJ_DIM, seed=seed, proj_type="normal"), id="dense-normal"),
    ProjectorCase(
        lambda seed=3: DenseProjector(GRAD_DIM, PROJ_DIM, seed=seed, block_rows=97, cache_bytes=0),
        id="dense-rademacher-nocache-smallblocks",
    ),
    ProjectorCase(lambda seed=3: BasicProjector(GRAD_DIM, PROJ_DIM, seed=seed, proj_type="rademacher"), id="basic"),
    ProjectorCase(
        lambda seed=3: BasicSingleBlockProjector(GRAD_DIM, PROJ_DIM, seed=seed, proj_type="normal"),
        id="single-block-normal",
    ),
    ProjectorCase(lambda: NoOpProjector(grad_dim=GRAD_DIM, proj_dim=GRAD_DIM), id="noop"),
    ProjectorCase(lambda seed=3: SJLTProjector(GRAD_DIM, PROJ_DIM, seed=seed), id="sjlt-c4"),
    ProjectorCase(
        lambda seed=3: SJLTProjector(GRAD_DIM, PROJ_DIM, seed=seed, c=1, block_rows=97, cache_bytes=0),
        id="sjlt-c1-nocache-smallblocks",
    ),
    ProjectorCase(
        lambda seed=3: FactoredProjector(GRAD_DIM, PROJ_DIM, seed=seed, proj_type="rademacher"),
        id="factored-flat-rademacher",
    ),
    ProjectorCase(
        lambda seed=3: FactoredProjector(GRAD_DIM, PROJ_DIM, seed=seed, proj_type="normal"), id="factored-flat-normal"
    ),
    ProjectorCase(lambda seed=3: FactoredProjector.from_model(_mlp(), PROJ_DIM, seed=seed), id="factored-mlp-layers"),
    ProjectorCase(
        lambda seed=3: make_projector("factored", GRAD_DIM, PROJ_DIM, seed, model=_mlp()), id="make_projector-factored"
    ),
    # cuda_ext's GPU projectors: the build-free torch path runs anywhere (here on the CPU) ...
    ProjectorCase(_cuda("CudaDenseProjector", device="cpu", backend="torch"), id="cuda-dense-torchpath-on-cpu"),
    ProjectorCase(
        _cuda("CudaDenseProjector", proj_type="normal", device="cpu", backend="torch"),
        id="cuda-dense-normal-torchpath-on-cpu",
    ),
    ProjectorCase(_cuda("CudaSJLTProjector", c=4, device="cpu", backend="torch"), id="cuda-sjlt-torchpath-on-cpu"),
    # ... the kernels and the GPU torch path need a GPU
    ProjectorCase(
        _cuda("CudaDenseProjector", device="cuda", backend="kernel", algo="fma"),
        id="cuda-dense-kernel-fma",
        marks=needs_cuda,
    ),
    ProjectorCase(
        _cuda("CudaDenseProjector", device="cuda", backend="kernel", algo="tc3"),
        id="cuda-dense-kernel-tc3",
        marks=needs_cuda,
    ),
    ProjectorCase(
        _cuda("CudaDenseProjector", proj_type="normal", device="cuda", backend="kernel"),
        id="cuda-dense-kernel-normal",
        marks=needs_cuda,
    ),
    ProjectorCase(
        _cuda("CudaSJLTProjector", c=4, device="cuda", backend="kernel"), id="cuda-sjlt-kernel", marks=needs_cuda
    ),
    ProjectorCase(
        _cuda("CudaDenseProjector", device="cuda", backend="torch"), id="cuda-dense-torchpath", marks=needs_cuda
    ),
    ProjectorCase(
        _cuda("CudaSJLTProjector", c=2, device="cuda", backend="torch"), id="cuda-sjlt-torchpath", marks=needs_cuda
    ),
    # not here: fast_jl (TRAK's kernel, optional; its matrix is not ours), see tests/cuda_ext/test_cuda_ext.py
]


# ------------------------------------------------------------------------------------------ model outputs
class TinyTextModel(torch.nn.Module):
    def __init__(self, vocab=20, dim=6, classes=3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.type_emb = torch.nn.Embedding(2, dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, input_ids, token_type_ids, attention_mask):
        h = self.emb(input_ids) + self.type_emb(token_type_ids)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))


class TinyCLIP(torch.nn.Module):
    def __init__(self, d_img=5, d_txt=4, dim=3):
        super().__init__()
        self.img = torch.nn.Linear(d_img, dim)
        self.txt = torch.nn.Linear(d_txt, dim)
        self.logit_scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, image, text):
        return self.img(image), self.txt(text), self.logit_scale.exp()


def _margin_reference(logits, labels):
    """log(p_y / (1 - p_y)) from plain logits."""
    p = torch.softmax(logits, -1)[torch.arange(len(labels)), labels]
    return torch.log(p) - torch.log1p(-p)


def _image_case(cls, case_id, **kw):
    model = make_model().double()
    x, y, _, _ = make_data(n=6)
    return ModelOutputCase(
        cls(),
        model,
        (x.double(), y),
        id=case_id,
        reference=lambda m, b: _margin_reference(m(b[0]), b[1]),
        bad_batches=[(x.double(), -y - 1), (x.double(), y.double()), (x.double(), y[:, None])],
        **kw,
    )


def _text_case():
    torch.manual_seed(0)
    model = TinyTextModel().double()
    ids, types = torch.randint(0, 20, (5, 4)), torch.randint(0, 2, (5, 4))
    mask = torch.ones(5, 4, dtype=torch.long)
    mask[:, 3] = 0
    labels = torch.randint(0, 3, (5,))
    return ModelOutputCase(
        TextClassificationModelOutput(),
        model,
        (ids, types, mask, labels),
        id="text",
        reference=lambda m, b: _margin_reference(m(*b[:3]), b[3]),
        bad_batches=[(ids, types[:, :3], mask, labels), (ids, types, mask)],
    )


def _clip_case():
    torch.manual_seed(1)
    model = TinyCLIP().double()
    bank_img, bank_txt = torch.randn(9, 3).double(), torch.randn(9, 3).double()
    img, txt = torch.randn(4, 5).double(), torch.randn(4, 4).double()

    def reference(m, b):
        ie, te, _ = m(*b)
        a = -torch.logsumexp(-(ie[:, None, :] * (te[:, None, :] - bank_txt[None])).sum(-1), dim=1)
        c = -torch.logsumexp(-(te[:, None, :] * (ie[:, None, :] - bank_img[None])).sum(-1), dim=1)
        return a + c

    return ModelOutputCase(
        CLIPModelOutput(simulated_batch_size=9),
        model,
        (img, txt),
        id="clip",
        reference=reference,
        bad_batches=[(img, txt, txt)],
        setup=lambda: CLIPModelOutput.set_embeddings(bank_img, bank_txt),
    )


MODEL_OUTPUTS = [
    _image_case(ImageClassificationModelOutput, "image"),
    _image_case(IterativeImageClassificationModelOutput, "image-iterative", batched_output=True),
    _text_case(),
    _clip_case(),
]


@parametrize_with_checks(PROJECTORS + MODEL_OUTPUTS)
def test_contract(obj, check):
    check(obj)


def test_every_model_output_class_and_projector_kind_is_checked():
    import trak_core.featurize.modelout as mo

    classes = {
        c
        for c in vars(mo).values()
        if isinstance(c, type) and issubclass(c, mo.AbstractModelOutput) and c is not mo.AbstractModelOutput
    }
    # the causal-LM output runs the same checks on a transformers GPT-2 (test_causal_lm.py::test_model_output_contract)
    elsewhere = {mo.CausalLMModelOutput}
    assert classes == {type(c.model_output) for c in MODEL_OUTPUTS} | elsewhere
    kinds = {c.make().kind for c in PROJECTORS if not c.marks and c.make().device != "cuda"}
    assert set(registered_projectors("cpu")) - {"fast_jl"} <= kinds


def test_ids_are_readable():
    ids = [ident for _, _, ident, _ in iter_checks(PROJECTORS[:1] + MODEL_OUTPUTS[:1])]
    assert "dense-rademacher-check_projector_batch_split" in ids and "image-check_model_output_reference" in ids


def test_testing_module_imports_without_pytest():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pytest'] = None; import trak_core.testing as t; "
        "from trak_core.projection.projectors import DenseProjector; "
        "t.check_projector(DenseProjector(50, 16)); print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


# ------------------------------------------------------------------------------------------ the suite can fail
class BatchDependentProjector(DenseProjector):
    """Broken: centres each batch (the vector of an example depends on the others)."""

    def project(self, grads, model_id):
        out = super().project(grads, model_id)
        return out - out.mean(0, keepdim=True)


class UnscaledProjector(DenseProjector):
    """Broken: says scale = 1 while its entries have unit variance (inner products off by proj_dim)."""

    @property
    def scale(self):
        return 1.0


class NoInputCheckProjector(DenseProjector):
    """Broken: pads or cuts any input instead of refusing it."""

    def project(self, grads, model_id):
        if isinstance(grads, dict):
            return super().project(grads, model_id)
        g = grads.reshape(-1, grads.shape[-1]) if grads.dim() != 2 else grads
        g = torch.nn.functional.pad(g, (0, max(0, self.grad_dim - g.shape[1])))[:, : self.grad_dim]
        return super().project(g, model_id)


@pytest.mark.parametrize(
    "broken, check",
    [
        (BatchDependentProjector, check_projector_batch_split),
        (UnscaledProjector, check_projector_inner_products),
        (NoInputCheckProjector, check_projector_refuses_bad_input),
    ],
    ids=["batch-dependent", "unscaled", "no-input-check"],
)
def test_broken_projectors_fail_their_check(broken, check):
    with pytest.raises(AssertionError, match=f"^{check.__name__}: "):
        check(lambda seed=3: broken(GRAD_DIM, PROJ_DIM, seed=seed))
    with pytest.raises(AssertionError, match=check.__name__):
        check_projector(lambda seed=3: broken(GRAD_DIM, PROJ_DIM, seed=seed))


class WeightIgnoringOutput(ImageClassificationModelOutput):
    """Broken: calls the module (its own parameters) instead of functional_call with the given weights."""

    @staticmethod
    def get_output(model, weights, buffers, image, label):
        return _margin_reference(model(image[None]), label.reshape(1))[0]


class PermissiveOutput(ImageClassificationModelOutput):
    """Broken: validates nothing."""

    def validate_batch(self, batch):
        pass


@pytest.mark.parametrize(
    "broken, check_name",
    [
        (WeightIgnoringOutput, "check_model_output_uses_weights"),
        (PermissiveOutput, "check_model_output_validate_batch"),
    ],
    ids=["ignores-weights", "validates-nothing"],
)
def test_broken_model_outputs_fail_their_check(broken, check_name):
    model = make_model().double()
    x, y, _, _ = make_data(n=4)
    with pytest.raises(AssertionError, match=f"^{check_name}: "):
        check_model_output(broken(), model, (x.double(), y))


def test_an_exception_in_a_check_names_the_check():
    class Crashing(DenseProjector):
        def spec(self):
            raise RuntimeError("boom")

    with pytest.raises(AssertionError, match=r"^check_projector_spec: raised RuntimeError: boom"):
        check_projector(lambda seed=3: Crashing(GRAD_DIM, PROJ_DIM, seed=seed))


# ------------------------------------------------------------------------------------------ the definition
def test_dense_entries_are_unit_variance_and_pure():
    for kind in ("rademacher", "normal"):
        p = DenseProjector(GRAD_DIM, PROJ_DIM, seed=11, proj_type=kind)
        mat = p.matrix(0)
        assert abs(float(mat.mean())) < 0.02 and abs(float(mat.var()) - 1) < 0.02
        # any row block equals the same rows of the whole matrix (pure function of the index)
        assert torch.equal(p.generate(0, 123, 456), mat[123:456])
        # and the definition does not depend on the instance's blocking
        q = DenseProjector(GRAD_DIM, PROJ_DIM, seed=11, proj_type=kind, block_rows=7, cache_bytes=0)
        assert torch.equal(q.matrix(0), mat)


def test_counter_rng_tensor_and_int_mixers_agree():
    xs = torch.tensor([0, 1, 2, 12345, 2**31, 2**32 - 1], dtype=torch.int64)
    assert counter_rng.mix32(xs).tolist() == [counter_rng.mix32_int(int(v)) for v in xs]


def test_rademacher_bits_follow_the_documented_layout():
    seed, mid, cols = 5, 2, 70
    mat = counter_rng.rademacher_block(seed, mid, 10, 12, cols)
    key = counter_rng.stream_key(seed, mid, counter_rng.STREAM_SIGN_WORDS)
    words = (cols + 31) // 32
    for r in (10, 11):
        for c in (0, 31, 32, 69):
            h = int(counter_rng.hash_counter(torch.tensor([r * words + c // 32]), key)[0])
            assert mat[r - 10, c] == (-1.0 if (h >> (c % 32)) & 1 else 1.0)


def test_64bit_counters():
    """Row indices beyond 2**32 / proj_dim work (no uint32 overflow) and differ from low rows."""
    big = 2**33 + 5
    a = counter_rng.rademacher_block(0, 0, big, big + 2, 64)
    b = counter_rng.rademacher_block(0, 0, 5, 7, 64)
    assert a.shape == (2, 64) and not torch.equal(a, b)


# ------------------------------------------------------------------------------------------ the registry
def test_make_projector_rejects_unknown_kind():
    with pytest.raises(BadInputError, match="unknown projector"):
        make_projector("fancy", 10, 5)
    with pytest.raises(BadInputError, match="proj_dim"):
        make_projector("dense", 10, 0)


class HalfProjector(AbstractProjector):
    """A user's projector: the first proj_dim coordinates, times √(grad_dim / proj_dim) (for tests only)."""

    kind = "test-half"

    def __init__(self, grad_dim, proj_dim, seed=0, proj_type="rademacher", device="cpu", **kwargs):
        super().__init__(grad_dim, proj_dim, seed, proj_type, device)

    def project(self, grads, model_id):
        self._check_input(grads)
        return grads[:, : self.proj_dim].to(torch.float32) * np.sqrt(self.grad_dim / self.proj_dim)


def test_register_a_projector_and_build_it_by_name():
    register_projector("test-half", HalfProjector)
    try:
        p = make_projector("test-half", 10, 4, model=object(), grad_wrt=["x"])  # model/grad_wrt not passed on
        assert isinstance(p, HalfProjector) and "test-half" in registered_projectors("cpu")
        register_projector("test-half", HalfProjector)  # the same factory again: a no-op
        with pytest.raises(BadInputError, match="already registered"):
            register_projector("test-half", lambda *a, **k: None)
        register_projector("test-half", DenseProjector, devices=["cuda"])  # a device-specific entry wins there
        assert find_projector("test-half", "cuda:0").factory is DenseProjector
        assert find_projector("test-half", "cpu").factory is HalfProjector
    finally:
        unregister_projector("test-half")
    assert "test-half" not in registered_projectors()
    with pytest.raises(BadInputError, match="unknown projector 'test-half'"):
        make_projector("test-half", 10, 4)
