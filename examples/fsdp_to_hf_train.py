"""Train a small ``transformers`` Llama with FSDP2 and save a universal checkpoint.

Step 1 of ``examples/fsdp_to_hf.md``. Run it under torchrun (CPU ranks, gloo;
no GPU and no download needed: the model is built from a local config)::

    torchrun --nproc-per-node 2 examples/fsdp_to_hf_train.py --out out/fsdp_to_hf

It writes, under ``--out``:

- ``ckpt/``: the training state ``{"model", "optim", "step"}`` saved with
  ``UCPStorageWriter`` + ``UCPSavePlanner`` (model and AdamW state, sharded
  by FSDP2 across the ranks);
- ``config/config.json``: the model's ``transformers`` config;
- ``eval.json``: the trained model's loss on a fixed evaluation batch, to
  compare with what the exported model gives after ``from_pretrained``.

The data are sequences that count up modulo the vocabulary size with a
random stride, so the loss falls quickly once the model reads the stride.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from ucp_dcp import UCPSavePlanner, UCPStorageWriter

VOCAB, SEQ = 64, 32


def config() -> LlamaConfig:
    """A small Llama: 2 layers, d_model 128, grouped-query attention, untied embeddings."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )


def batch(step: int, n: int) -> torch.Tensor:
    """``n`` sequences counting up mod VOCAB with random start and stride (same on every rank)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/fsdp_to_hf", help="output directory (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="global batch size (default: %(default)s)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step in range(args.steps):
        ids = batch(step, args.batch)[rank::world]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim), "step": args.steps}
    dcp.save(state, storage_writer=UCPStorageWriter(os.path.join(args.out, "ckpt")), planner=UCPSavePlanner())

    with torch.no_grad():
        ids = batch(10**6, 8)  # the evaluation batch: every rank runs all of it
        eval_loss = model(input_ids=ids, labels=ids).loss.item()
    if rank == 0:
        config().save_pretrained(os.path.join(args.out, "config"))
        with open(os.path.join(args.out, "eval.json"), "w") as f:
            json.dump({"eval_loss": eval_loss, "eval_seed": 10**6, "eval_batch": 8}, f)
        print(f"saved {args.out}/ckpt (model + AdamW, {world} FSDP2 ranks); eval loss {eval_loss:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
