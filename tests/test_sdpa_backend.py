"""memdoctor.cuda.sdpa_backend picks scaled_dot_product_attention's CUDA kernel by PyTorch's
rules (sdp_utils.cpp), one test per rule, on meta tensors; and the CPU standing in for CUDA
runs the kernel picked, so that the math fallback keeps the softmax and the fused kernels do
not (benchmarks/zoo_accuracy.py checks the rules against the dispatcher on a GPU)."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from memdoctor.cuda.sdpa_backend import SdpaRules, choose
from memdoctor.predict.cpu_standin import attention_as_on_cuda

F32, BF16 = torch.float32, torch.bfloat16


def qkv(dtype=F32, heads=16, kv=None, seq=256, kv_seq=None, d=64, batch=2, grad=True):
    kv = kv or heads
    q = torch.empty(batch, heads, seq, d, dtype=dtype, device="meta", requires_grad=grad)
    k = torch.empty(batch, kv, kv_seq or seq, d, dtype=dtype, device="meta", requires_grad=grad)
    v = torch.empty(batch, kv, kv_seq or seq, d, dtype=dtype, device="meta", requires_grad=grad)
    return q, k, v


def mask(seq=256, kv_seq=None, dtype=torch.bool, shape=None):
    return torch.empty(shape or (2, 1, seq, kv_seq or seq), dtype=dtype, device="meta")


def test_half_precision_takes_cudnn_on_hopper_and_flash_where_cudnn_is_not_preferred():
    assert choose(*qkv(BF16)) == "cudnn"
    assert choose(*qkv(torch.float16)) == "cudnn"
    assert choose(*qkv(BF16), rules=SdpaRules(prefer_cudnn=False)) == "flash"


def test_fp32_takes_memory_efficient_attention():
    assert choose(*qkv(F32)) == "efficient"
    assert choose(*qkv(F32), is_causal=True) == "efficient"


def test_fp32_grouped_query_attention_falls_back_to_math():
    """Neither flash (fp16/bf16 only) nor memory-efficient attention (same heads only, up to
    torch 2.12) takes it: the math kernel materialises the softmax."""
    assert choose(*qkv(F32, 14, 2), enable_gqa=True) == "math"
    assert choose(*qkv(F32, 14, 2), enable_gqa=True, rules=SdpaRules(efficient_gqa=True)) == "efficient"


def test_half_precision_grouped_query_attention_stays_fused():
    assert choose(*qkv(BF16, 14, 2), enable_gqa=True) == "cudnn"
    assert choose(*qkv(BF16, 14, 2), enable_gqa=True, rules=SdpaRules(prefer_cudnn=False)) == "flash"
    # differing heads without enable_gqa: neither flash nor cuDNN takes them (the H200's dispatcher)
    assert choose(*qkv(BF16, 8, 1)) == "math"
    assert choose(*qkv(BF16, 8, 1), rules=SdpaRules(prefer_cudnn=False)) == "math"


def test_a_mask_rules_out_flash_but_not_cudnn_or_memory_efficient():
    assert choose(*qkv(BF16), mask()) == "cudnn"
    assert choose(*qkv(BF16), mask(), rules=SdpaRules(prefer_cudnn=False)) == "efficient"
    assert choose(*qkv(F32), mask()) == "efficient"
    assert choose(*qkv(F32), mask(dtype=F32, shape=(256, 256))) == "efficient"


def test_a_mask_whose_last_dim_is_not_contiguous_takes_math():
    strided = torch.empty(2, 1, 256, 512, dtype=torch.bool, device="meta")[..., ::2]
    assert choose(*qkv(F32), strided) == "math"


def test_cudnn_refuses_a_mask_that_needs_grad_or_has_an_odd_shape():
    needs_grad = torch.empty(2, 1, 256, 256, dtype=BF16, device="meta", requires_grad=True)
    assert choose(*qkv(BF16), needs_grad) == "efficient"
    three_d = torch.empty(2, 256, 256, dtype=torch.bool, device="meta")
    assert choose(*qkv(BF16), three_d) == "efficient"


def test_head_dims_beyond_cudnns_limit_go_to_flash_and_odd_ones_to_math():
    assert choose(*qkv(BF16, d=256)) == "cudnn"
    assert choose(*qkv(BF16, 8, d=256), rules=SdpaRules(cudnn_max_head_dim=128)) == "flash"
    assert choose(*qkv(BF16, d=264)) == "efficient"     # beyond cuDNN and flash
    assert choose(*qkv(F32, d=72)) == "efficient"
    assert choose(*qkv(F32, d=70)) == "math"             # fp32 needs a multiple of 4
    assert choose(*qkv(BF16, d=36)) == "flash"           # cuDNN needs a multiple of 8; flash pads


def test_cudnn_takes_any_dropout():
    assert choose(*qkv(BF16), dropout_p=0.1) == "cudnn"
    assert choose(*qkv(BF16), dropout_p=0.125) == "cudnn"


def _measured_rows():
    import json
    from pathlib import Path
    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    path = results / "zoo_accuracy_h200_2026-12-01.json"
    return json.loads(path.read_text())["checks"]["sdpa"]["rows"]


def test_the_rules_pick_what_the_h200s_dispatcher_picked():
    """Every case benchmarks/zoo_accuracy.py put to torch._fused_sdp_choice on an H200
    (torch 2.11, cuDNN 9.19), rebuilt here on meta tensors: the same backend."""
    rows = _measured_rows()
    assert len(rows) >= 150
    wrong = []
    for row in rows:
        dtype = getattr(torch, row["dtype"])
        heads, kv, seq, d = int(row["heads"]), int(row["kv"]), int(row["seq"]), int(row["d"])
        q, k, v = qkv(dtype, heads, kv, seq=seq, d=d)
        m = None
        if row["mask"] == "bool":
            m = mask(seq)
        elif row["mask"] == "float":
            m = mask(seq, dtype=dtype)
        elif row["mask"] == "bool-padded":
            m = torch.empty(2, 1, seq, seq + 3, dtype=torch.bool, device="meta")[..., :seq]
        got = choose(q, k, v, m, float(row["dropout"]), row["causal"] == "True", row["gqa"] == "True",
                     rules=SdpaRules(sm=(9, 0)))
        if got != row["dispatcher"]:
            wrong.append((row, got))
    assert not wrong, wrong[:3]


def test_flash_refuses_causal_attention_with_fewer_queries_than_keys():
    q, k, v = qkv(BF16, seq=128, kv_seq=256)
    assert choose(q, k, v, is_causal=True, rules=SdpaRules(prefer_cudnn=False)) == "efficient"


def test_the_backends_the_user_turned_off_are_skipped():
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert choose(*qkv(BF16)) == "flash"
        assert choose(*qkv(F32)) == "math"


def test_deterministic_algorithms_rule_out_cudnn():
    assert choose(*qkv(BF16), rules=SdpaRules(deterministic=True)) == "flash"


def test_misaligned_storage_offsets_rule_out_memory_efficient_attention():
    base = torch.empty(2, 16, 256, 64 * 3 + 2, dtype=F32, device="meta")
    q = base[..., 2:66]
    assert q.storage_offset() % 4
    assert choose(q, *qkv(F32)[1:]) == "math"


def test_different_batch_sizes_take_math():
    q, _, _ = qkv(F32, batch=2)
    _, k, v = qkv(F32, batch=1)
    assert choose(q, k, v) == "math"


@pytest.mark.parametrize("dtype, gqa, softmax_kept", [(F32, False, False), (F32, True, True), (BF16, True, False)])
def test_the_standin_keeps_the_softmax_exactly_when_cuda_runs_math(dtype, gqa, softmax_kept):
    """On fake CPU tensors standing in for CUDA: the tensors saved for backward include one of
    batch x heads x queries x keys values only on the math path."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    seq = 128
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with FakeTensorMode():
        q = torch.empty(2, 8, seq, 64, dtype=dtype, requires_grad=True)
        k = torch.empty(2, 2 if gqa else 8, seq, 64, dtype=dtype, requires_grad=True)
        v = torch.empty(2, 2 if gqa else 8, seq, 64, dtype=dtype, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = attention_as_on_cuda(q, k, v, is_causal=True, enable_gqa=gqa)
    assert out.shape == (2, 8, seq, 64)
    assert any(s[-2:] == (seq, seq) and s[1] == 8 for s in saved) == softmax_kept


def test_the_standin_makes_a_boolean_mask_additive_as_the_dispatcher_does():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 8, 64, 64, requires_grad=True)
        m = torch.ones(2, 1, 64, 64, dtype=torch.bool)
        out = attention_as_on_cuda(q, q, q, attn_mask=m)
    assert out.shape == q.shape
