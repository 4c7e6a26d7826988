"""A tiny GPT-2 sequence classifier and its data, for the sharded (FSDP2) featurization tests: importable by
spawned ranks and by the pipeline's config (``tests.sharded_models:make_model``)."""

from __future__ import annotations

import torch
import transformers
from torch import nn

VOCAB, SEQ, CLASSES = 24, 8, 3
NUM_TRAIN, NUM_TARGETS = 32, 6


class GPT2Classifier(nn.Module):
    """transformers' GPT2Model (Conv1D layers, token and position embeddings, LayerNorms) with a linear head on
    the mean of its last hidden states: logits (B, CLASSES) from token ids (B, SEQ)."""

    def __init__(self) -> None:
        super().__init__()
        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=1,
            pad_token_id=None,
        )
        cfg._attn_implementation = "eager"
        self.gpt = transformers.GPT2Model(cfg)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.gpt(input_ids=ids).last_hidden_state.mean(dim=1))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT2Classifier().eval()


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    return ids, (ids[:, 0] % CLASSES).long()


def train_data() -> tuple[torch.Tensor, torch.Tensor]:
    return _data(NUM_TRAIN, 1)


def target_data() -> tuple[torch.Tensor, torch.Tensor]:
    return _data(NUM_TARGETS, 2)


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2 over the default process group: each transformer block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.gpt.h:
        fully_shard(block)
    fully_shard(model)
    return model


#: set by a test to a file path: while the file exists, rank 1 exits (as a killed process) when it featurizes a
#: batch holding the train row the file names (a file, not a variable: the ranks fork from a server that keeps
#: the environment it started with)
DIE_AT_ROW_ENV = "TRAKFLOW_TEST_RANK1_DIES_AT_ROW_FILE"


class _Dying(GPT2Classifier):
    """The classifier whose rank 1 ends its process (os._exit, as a SIGKILL would) on a batch holding the train
    row written in the file :data:`DIE_AT_ROW_ENV` names, while that file exists."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        import os

        import torch.distributed as dist

        path = os.environ.get(DIE_AT_ROW_ENV)
        if path and os.path.exists(path) and dist.is_initialized() and dist.get_rank() == 1:
            x, _ = train_data()
            with open(path) as f:
                row = int(f.read())
            if (ids.unsqueeze(1) == x[row]).all(-1).any():
                os._exit(9)
        return super().forward(ids)


def make_dying_model() -> nn.Module:
    torch.manual_seed(0)
    return _Dying().eval()
