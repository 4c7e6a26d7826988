"""The pipeline on a LoRA model: the config's model factory returns a peft model, its checkpoint is the
``adapter_model.safetensors`` file ``save_pretrained`` writes; the featurize, finalize and score flows give TRAKer's
scores on the same inputs, the store's grad_dim is the adapters', and another adapter file is refused."""

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tasks.config import AttributeConfig  # noqa: E402
from trak_core import TRAKer  # noqa: E402
from trak_core.errors import BadInputError, StoreMismatchError  # noqa: E402
from trak_core.featurize.adapters import read_state_file  # noqa: E402
from trak_core.featurize.gradients import grad_dim_of  # noqa: E402
from trak_core.featurize.lm import causal_lm_batch  # noqa: E402
from trak_core.projection.projectors import make_projector, rebuild_kwargs  # noqa: E402
from trak_core.store import TrakStore  # noqa: E402

pytestmark = pytest.mark.usefixtures("prefect_harness")
N, M, PROJ, LAM = 32, 3, 16, 1e-2


def make_model():
    """A tiny GPT-2 with LoRA (rank 2, random A and B) on its attention and first MLP layers."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=24, n_positions=16, n_embd=8, n_layer=2, n_head=2, pad_token_id=0)
    lora = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM, r=2, target_modules=["c_attn", "c_fc"], init_lora_weights=False
    )
    return peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), lora).eval()


def rows(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 24, (int(k),), generator=g).tolist() for k in torch.randint(3, 9, (n,), generator=g)]
    return causal_lm_batch(seqs, 10, 0, "left")


def train_rows():
    return rows(N, 11)


def target_rows():
    return rows(M, 12)


def config(tmp_path, ckpt, store="store.zarr"):
    return AttributeConfig.model_validate(
        dict(
            model="test_peft_pipeline:make_model",
            train_data="test_peft_pipeline:train_rows",
            target_data="test_peft_pipeline:target_rows",
            task="causal_lm",
            checkpoints=[str(ckpt)],
            store=str(tmp_path / store),
            exp_name="lora",
            proj_dim=PROJ,
            lambda_reg=LAM,
            dtype="float32",
            batch_size=8,
            shard_size=16,
            chunk_rows=8,
            device="cpu",
            max_workers=1,
            report_targets=0,
            report_dir=None,
        )
    )


def test_flows_on_an_adapter_file_equal_traker(tmp_path):
    from flows import featurize, finalize, score

    model = make_model()
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "ck")
    ckpt = tmp_path / "ck" / "adapter_model.safetensors"
    cfg = config(tmp_path, ckpt)
    featurize(cfg)
    finalize(cfg)
    score(cfg)
    st = TrakStore.open(cfg.store, mode="r")
    fresh = make_model()
    assert (
        st.meta.grad_dim == grad_dim_of(fresh) == sum(v.numel() for v in peft.get_peft_model_state_dict(fresh).values())
    )
    got = st.scores(cfg.exp_name)[:]

    kw = rebuild_kwargs("factored", st.meta.projector_params)  # the plan's split
    proj = make_projector("factored", grad_dim_of(fresh), PROJ, 0, "rademacher", "cpu", model=fresh, **kw)
    tr = TRAKer(
        fresh,
        "causal_lm",
        N,
        save_dir=str(tmp_path / "traker.zarr"),
        device="cpu",
        projector=proj,
        use_half_precision=False,
        lambda_reg=LAM,
        chunk_rows=8,
        shard_rows=16,
        logging_level=logging.ERROR,
    )
    sd = read_state_file(ckpt)
    tr.load_checkpoint(sd, 0)
    train = train_rows()
    for a in range(0, N, 8):
        tr.featurize(tuple(t[a : a + 8] for t in train), inds=np.arange(a, a + 8))
    tr.finalize_features()
    tr.start_scoring_checkpoint(cfg.exp_name, sd, 0, M)
    tr.score(target_rows(), num_samples=M)
    want = np.asarray(tr.finalize_scores(cfg.exp_name))
    assert got.shape == (N, M)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())

    # another adapter written over the recorded file: refused by its sha256 before anything is featurized
    torch.manual_seed(4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "ck")
    with pytest.raises((BadInputError, StoreMismatchError)):
        featurize(cfg)
