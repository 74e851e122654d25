"""Make the torch_dist fixtures of ``tests/conventions/test_megatron_core_fixtures.py``: two
tiny GPT models built and saved by Megatron-Core itself (not by the harness), with what
their weights are in the harness's canonical terms.

Run once, by hand, in a venv with megatron-core 0.16.1 (the newest that installs on Python
3.11; ``pip install --no-deps megatron-core==0.16.1 numpy packaging psutil`` beside torch
2.13.0 CPU), with ``PYTHONPATH`` holding the harness's ``src``:

    python tests/data/megatron_core/make_fixtures.py tests/data/megatron_core

What it writes, per model: the checkpoint directory ``dist_checkpointing.save`` wrote, and
``expected.json``: each canonical parameter's shape, dtype and the SHA-256 of its bytes,
computed from the model's own in-memory parameters (each rank's local tensors, renamed
from the local layer spec to the TE spec's names the ``megatron`` convention uses, and
gathered with the convention's index maps), never from the checkpoint.

- ``dense_tp2``: TP 2 over two gloo processes (fc1's global tensor is every rank's gate
  chunk, then every up chunk: not the ranks' local tensors concatenated);
- ``moe_tp1``: SequentialMLP experts (``local_experts.{j}``), whose pre-MLP norm the local
  spec saves as ``mlp.linear_fc1.layer_norm_weight`` (its ``sharded_state_dict_keys_map``),
  where the TE spec saves ``pre_mlp_layernorm.weight``.

CPU shims, none of which changes what is written: ``torch.cuda.synchronize`` and
``torch.cuda.current_device`` (called by the save path), the ``allgather`` token dispatcher
(``alltoall`` builds a CUDA stream), ``torch.manual_seed`` for
``model_parallel_cuda_manual_seed``. Norms get random values, so a norm read from the
wrong place shows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import warnings

import torch

GEOMETRY = dict(vocab=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, ffn=32)
MOE = dict(n_experts=4, top_k=2, expert_ffn=8)


def _megatron(rank: int, world: int, tp: int, port: int):
    warnings.filterwarnings("ignore")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234 + rank)
    return parallel_state


def _build(moe: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    g = GEOMETRY
    kw = dict(num_layers=g["n_layers"], hidden_size=g["d_model"],
              num_attention_heads=g["n_heads"], num_query_groups=g["n_kv_heads"],
              kv_channels=g["head_dim"], ffn_hidden_size=g["ffn"], gated_linear_unit=True,
              activation_func=torch.nn.functional.silu, add_bias_linear=False,
              use_cpu_initialization=True, normalization="RMSNorm",
              params_dtype=torch.float32, bf16=False)
    if moe:
        kw.update(num_moe_experts=MOE["n_experts"], moe_router_topk=MOE["top_k"],
                  moe_ffn_hidden_size=MOE["expert_ffn"], moe_grouped_gemm=False,
                  moe_token_dispatcher_type="allgather")
    spec = get_gpt_layer_local_spec(num_experts=MOE["n_experts"] if moe else None,
                                    moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config=TransformerConfig(**kw), transformer_layer_spec=spec,
                     vocab_size=g["vocab"], max_sequence_length=64,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p))
    return model


def _save(model, directory: str, parallel_state) -> None:
    from megatron.core import dist_checkpointing

    metadata = {"distrib_optim_sharding_type": "dp_reshardable",
                "singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(
                    with_context_parallel=True)}
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(metadata=metadata), directory)


def _worker(rank: int, world: int, tp: int, moe: bool, out: str, port: int) -> None:
    parallel_state = _megatron(rank, world, tp, port)
    model = _build(moe)
    torch.save({k: v.clone() for k, v in model.state_dict().items()
                if not k.endswith("_extra_state")}, f"{out}.rank{rank}.pt")
    _save(model, out, parallel_state)
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def _expected(out: str, world: int, where: str, moe: bool) -> None:
    from weight_sync_bench.conventions import endpoint
    from weight_sync_bench.conventions.maps import gather_canonical
    from weight_sync_bench.model.config import ModelConfig

    config = ModelConfig(name="mcore", **GEOMETRY, **(MOE if moe else {}))
    at = endpoint(where)
    pieces = at.pieces(config)
    shards = []
    for rank in range(world):
        local = torch.load(f"{out}.rank{rank}.pt")
        renamed = {}
        for name, x in local.items():
            name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
            if not moe:
                name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
            renamed[name] = x
        missing = [n for n in pieces[rank] if n not in renamed]
        assert not missing, missing
        shards.append({n: renamed[n] for n in pieces[rank]})
        os.remove(f"{out}.rank{rank}.pt")
    canonical = gather_canonical(shards, pieces, config.param_shapes())
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"megatron_core": "0.16.1", "saved_at": where, "geometry": config.geometry()
                   if hasattr(config, "geometry") else None,
                   "params": {n: {"shape": list(x.shape), "dtype": str(x.dtype),
                                  "sha256": hashlib.sha256(x.contiguous().numpy().tobytes())
                                  .hexdigest()} for n, x in sorted(canonical.items())}},
                  f, indent=1, sort_keys=True, default=str)


def main(root: str) -> None:
    import torch.multiprocessing as mp

    os.makedirs(root, exist_ok=True)
    for name, world, tp, moe, where, port in (
            ("dense_tp2", 2, 2, False, "megatron:tp=2,vocab=unpadded", 29611),
            ("moe_tp1", 1, 1, True, "megatron:tp=1,vocab=unpadded,experts=sequential", 29612)):
        out = os.path.join(root, name)
        shutil.rmtree(out, ignore_errors=True)
        mp.spawn(_worker, args=(world, tp, moe, out, port), nprocs=world, join=True)
        _expected(out, world, where, moe)
        print(name, sorted(os.listdir(out)))


if __name__ == "__main__":
    main(sys.argv[1])
