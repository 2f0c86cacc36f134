"""benchmarks/peers without the peers installed: the configuration and the megatron3d flags
it becomes, the shared batches, the weight-name mapping (checked by running both models),
gradient clipping, the row runner's failure reasons, the table formatter and the
Megatron-Core CPU redirects (tested on their own: ``apply()`` patches torch globally)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from benchmarks.peers import bandwidth, runner
from benchmarks.peers.batches import make_batches, rank_micro_batches
from benchmarks.peers.config import REFERENCE, PeerConfig, Row, all_rows, build_config
from benchmarks.peers.gpt2 import GPT2
from benchmarks.peers.mcore_cpu import _CpuTorch, _cuda_type_name
from benchmarks.peers.names import (
    MCORE_HEAD,
    TIED_HEAD,
    mcore_name,
    megatron3d_name_of_mcore,
    stage_state,
    to_torch_gpt2,
    torch_gpt2_name,
)
from benchmarks.peers.run_megatron3d import megatron3d_argv
from benchmarks.peers.runner import RowResult, first_error, missing_package
from benchmarks.peers.table import LOSS_TOLERANCE, disagreeing, format_tables
from benchmarks.peers.torch_optim import clip_grads
from megatron3d.cli.arguments import parse_args
from megatron3d.data.mock import MockGPTDataset
from megatron3d.data.sampler import micro_batches
from megatron3d.model.gpt import build_gpt
from megatron3d.mpu.meta import get_meta
from megatron3d.validation import validate
from tests.helpers.tiny import layer_context, model_config

TINY = PeerConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=128,
                  global_batch_size=8, micro_batch_size=2, steps=3)


def test_config_round_trips_and_quick_is_ten_steps(tmp_path):
    assert build_config(quick=True).steps == 10  # the loss check's length
    assert build_config(quick=False).steps > build_config(quick=True).steps
    TINY.to_json(tmp_path / "c.json")
    assert PeerConfig.from_json(tmp_path / "c.json") == TINY
    row = Row(framework="megatron3d", variant="x", tp=2, pp=2, dp=2, options=(("zero", "1"),))
    assert Row.from_dict(row.to_dict()) == row and row.world_size == 8


@pytest.mark.parametrize("row", [r for r in all_rows() if r.framework == "megatron3d"],
                         ids=lambda r: f"{r.variant}{r.layout}")
def test_megatron3d_flags_carry_the_config(row):
    cfg = build_config(quick=True)
    train = parse_args(megatron3d_argv(cfg, row))
    validate(train, row.world_size)  # a layout megatron3d refuses would fail the row later
    assert (train.model.num_layers, train.model.hidden_size, train.model.seq_length) == (
        cfg.num_layers, cfg.hidden_size, cfg.seq_length)
    assert train.training.train_iters == cfg.steps
    assert (train.optimizer.lr, train.optimizer.clip_grad) == (cfg.lr, cfg.clip_grad)
    assert train.parallel.tensor_model_parallel_size == row.tp
    assert train.parallel.zero_stage == int(row.option("zero", "0"))


def test_every_peer_row_names_a_megatron3d_baseline_at_its_layout():
    rows = all_rows()
    ours = {(r.layout, r.variant) for r in rows if r.framework == "megatron3d"}
    assert REFERENCE in rows
    for r in rows:
        assert (r.layout, r.baseline) in ours, r.label


def test_batches_are_what_megatron3d_reads():
    tokens = make_batches(TINY)  # [steps, G, s + 1]
    mock = MockGPTDataset(TINY.vocab_size, TINY.seq_length, TINY.seed)
    step = 2
    for dp_rank in range(2):
        ours = rank_micro_batches(tokens[step], dp_rank, 2, TINY.micro_batch_size)
        theirs = micro_batches(mock, step * TINY.global_batch_size, TINY.global_batch_size,
                               TINY.micro_batch_size, dp_rank, 2, torch.device("cpu"))
        assert len(ours) == len(theirs) == 2
        for (inputs, labels), mb in zip(ours, theirs, strict=True):
            assert torch.equal(inputs, mb.tokens) and torch.equal(labels, mb.labels)


def _megatron3d_model():
    cfg = model_config(vocab_size=TINY.vocab_size, make_vocab_size_divisible_by=8)
    model = build_gpt(layer_context(cfg))
    return model, {get_meta(p).name: p.detach() for p in model.parameters()}


def test_weight_names_map_one_to_one():
    _, weights = _megatron3d_model()
    names = [torch_gpt2_name(n) for n in weights]
    assert len(set(names)) == len(names)
    expected = GPT2(TINY).state_dict()
    mapped = to_torch_gpt2(weights)
    assert mapped.keys() == expected.keys()
    for name, value in expected.items():
        assert mapped[name].shape == value.shape, name
    with pytest.raises(KeyError, match="no mapping"):
        torch_gpt2_name("layers.0.attention.rotary.inv_freq")


MCORE_LAYER = {  # GPTModel's names of one layer (local spec), as megatron-core 0.16.1 has them
    "decoder.layers.{}.input_layernorm.weight", "decoder.layers.{}.input_layernorm.bias",
    "decoder.layers.{}.self_attention.linear_proj.weight",
    "decoder.layers.{}.self_attention.linear_proj.bias",
    "decoder.layers.{}.self_attention.linear_qkv.weight",
    "decoder.layers.{}.self_attention.linear_qkv.bias",
    "decoder.layers.{}.pre_mlp_layernorm.weight", "decoder.layers.{}.pre_mlp_layernorm.bias",
    "decoder.layers.{}.mlp.linear_fc1.weight", "decoder.layers.{}.mlp.linear_fc1.bias",
    "decoder.layers.{}.mlp.linear_fc2.weight", "decoder.layers.{}.mlp.linear_fc2.bias"}


def test_megatron_core_names_both_ways_on_pipeline_chunks():
    _, weights = _megatron3d_model()  # 2 layers: chunk 0 holds layer 0, chunk 1 layer 1
    first = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
             *(n.format(0) for n in MCORE_LAYER)}
    last = {*(n.format(0) for n in MCORE_LAYER), "decoder.final_layernorm.weight",
            "decoder.final_layernorm.bias", MCORE_HEAD}
    imported = [megatron3d_name_of_mcore(n, 0) for n in first] + [
        megatron3d_name_of_mcore(n, 1) for n in last]
    assert sorted(set(imported)) == sorted(weights)  # every weight, the head as the embedding
    assert megatron3d_name_of_mcore("decoder.layers.0.mlp.linear_fc2.bias", 1) == \
        "layers.1.mlp.fc2.bias"
    for name in weights:  # export then import is the identity
        offset = int(name.split(".")[1]) if name.startswith("layers.") else 0
        assert megatron3d_name_of_mcore(mcore_name(name, offset), offset) == name
    assert mcore_name("layers.1.attention.qkv.weight", 1) == \
        "decoder.layers.0.self_attention.linear_qkv.weight"


def test_plain_gpt2_with_mapped_weights_computes_megatron3d_logits():
    model, weights = _megatron3d_model()
    plain = GPT2(TINY)
    plain.load_state_dict(to_torch_gpt2(weights))
    tokens = make_batches(TINY)[0, :, :-1]
    with torch.no_grad():
        expected = model(tokens).transpose(0, 1)  # [s, b, v] -> [b, s, v]
        torch.testing.assert_close(plain(tokens), expected, rtol=1e-5, atol=1e-5)


def test_a_last_pipeline_stage_gets_a_copy_of_the_embedding_as_its_head():
    _, weights = _megatron3d_model()
    stage = GPT2(TINY, range(1, 2), first=False, last=True)
    state = stage_state(list(stage.state_dict()), weights)
    stage.load_state_dict(state)
    word = weights["embedding.word_embeddings.weight"]
    assert torch.equal(stage.head.weight, word)
    assert stage.head.weight.data_ptr() != word.data_ptr()
    assert "blocks.1.attn.qkv.weight" in state and "blocks.0.attn.qkv.weight" not in state
    assert TIED_HEAD in state and "wte.weight" not in state


def test_clipping_matches_torch_and_skips_counting_copies():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins, strict=True):
        t.grad = p.grad.clone()
    norm = clip_grads(params, 1.0, None)
    expected = torch.nn.utils.clip_grad_norm_(twins, 1.0)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p.grad, t.grad, rtol=1e-5, atol=1e-6)
    copy = torch.nn.Parameter(torch.zeros(2))
    copy.grad = torch.full((2,), 100.0)
    assert clip_grads([params[0], copy], 1.0, None, copies=(copy,)) == pytest.approx(
        float(params[0].grad.norm()), rel=1e-6)


def test_runner_states_why_a_row_did_not_run(monkeypatch):
    monkeypatch.setitem(runner.NEEDS, "megatron-core", "surely_not_installed_package")
    row = Row(framework="megatron-core", variant="DDP", dp=2)
    assert "megatron-core not installed" in missing_package(row)
    assert missing_package(REFERENCE) == ""
    log = ("noise\nTraceback (most recent call last):\n  File x\n"
           "RuntimeError: Connection reset by peer\nmore noise\n")
    assert first_error(log) == "RuntimeError: Connection reset by peer"
    assert first_error("") == "failed without output"


def test_limited_bandwidth_needs_root_and_the_tools(monkeypatch):
    monkeypatch.setattr(bandwidth.os, "geteuid", lambda: 1000)
    assert "root" in bandwidth.unavailable()
    monkeypatch.setattr(bandwidth.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bandwidth.shutil, "which", lambda tool: None)
    assert bandwidth.unavailable() == "needs ip and tc (apt-get install iproute2)"
    monkeypatch.setattr(bandwidth.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    assert bandwidth.unavailable() == ""


def test_limited_bandwidth_limits_the_namespace_loopback_and_runs_every_rank_inside(
        monkeypatch, tmp_path):
    commands = bandwidth.setup_commands("2gbit")
    inside = ["ip", "netns", "exec", bandwidth.NAMESPACE]
    assert commands[0] == ["ip", "netns", "add", bandwidth.NAMESPACE]
    assert commands[-1][:4] == inside and commands[-1][4:9] == ["tc", "qdisc", "add", "dev",
                                                                 "lo"]
    assert commands[-1][commands[-1].index("rate") + 1] == "2gbit"
    ran = []

    def fake_run(cmd, **kwargs):
        ran.append(cmd)
        kwargs["stdout"].write("RuntimeError: stopped here\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    result = runner.run_row(REFERENCE, tmp_path, tmp_path / "row", 5.0, inside)
    assert ran[0][:4] == inside and "torch.distributed.run" in ran[0]  # torchrun inside
    assert result.reason.startswith("RuntimeError: stopped here")


def _result(row: Row, losses: list[float], step_s: float, rss_mib: int,
            comm: tuple[int, int] = (0, 0)) -> RowResult:
    times = [[step_s * 10] + [step_s] * (len(losses) - 1)] * row.world_size
    tallies = [{"calls": comm[0] - rank, "bytes": comm[1] * (rank + 1) // row.world_size}
               for rank in range(row.world_size)]  # the last rank sends the most
    return RowResult(row, losses=[losses], times=[times],
                     peak_rss=[rss_mib * 2**20] * row.world_size, comm=tallies)


def test_table_has_a_section_per_layout_ratios_and_reasons():
    ref = _result(REFERENCE, [7.0, 6.5, 6.0], 0.2, 500)
    ours = Row(framework="megatron3d", variant="ZeRO-3", dp=2, options=(("zero", "3"),),
               baseline="ZeRO-3")
    fsdp = Row(framework="pytorch", variant="FSDP2", dp=2, baseline="ZeRO-3")
    mcore = Row(framework="megatron-core", variant="DDP", dp=2, baseline="ZeRO-3")
    results = [ref, _result(ours, [7.0, 6.5, 6.0], 0.1, 400),
               _result(fsdp, [7.0, 6.5, 6.0 + 3e-6], 0.15, 450, comm=(12, 3 * 2**20)),
               RowResult(mcore, reason="megatron-core not installed")]
    text = format_tables(results, warmup=1)
    sections = text.split("(TP, PP, DP) = ")
    assert [s.split("\n")[0] for s in sections[1:]] == ["(1,1,1)", "(1,1,2)"]
    fsdp_line = next(line for line in text.splitlines() if "FSDP2" in line)
    cells = [c.strip() for c in fsdp_line.strip("|").split("|")]
    # the warm-up step left out; collectives of the rank moving the most bytes
    assert cells[2:] == ["150.0", "1.50", "450", "11", "3.00", "3.0e-06"]
    assert "| megatron-core | DDP | not run: megatron-core not installed |" in text
    assert disagreeing(results, 1) == []
    results[2] = _result(fsdp, [7.0, 6.5, 6.0 + 2 * LOSS_TOLERANCE], 0.15, 450)
    assert disagreeing(results, 1) == ["pytorch FSDP2 (1,1,2)"]


def test_table_refuses_without_the_reference():
    with pytest.raises(ValueError, match="reference"):
        format_tables([RowResult(REFERENCE, reason="crashed")], warmup=1)


def test_mcore_cpu_redirects_only_cuda_requests():
    proxied = _CpuTorch()
    assert proxied.zeros(2, device="cuda").device.type == "cpu"
    assert proxied.tensor([1.0], dtype=torch.float, device="cuda:0").device.type == "cpu"
    assert proxied.empty(3).shape == (3,) and proxied.float32 is torch.float32
    x = torch.ones(2)
    assert _cuda_type_name(x) == "torch.cuda.FloatTensor"
    assert _cuda_type_name(x, torch.float64).dtype == torch.float64  # conversions unchanged
