"""Kernel scratch: the memory CUDA kernels take and give back inside one call. Sizes are
checked against allocator traces recorded on an H200 (torch 2.11+cu130); the estimate puts
them into its Run where the kernel runs."""
import torch
from torch import nn

from memdoctor.cuda.kernel_scratch import Gpu, scratch_for
from memdoctor.predict.estimate import estimate
from memdoctor.run import Action

aten = torch.ops.aten
H200 = Gpu(sm_count=132, max_threads_per_sm=2048)


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def sizes(scratch):
    return [s.nbytes for s in scratch]


def test_bias_gradient_sum_takes_the_staging_buffer_measured_on_the_h200():
    # ViT-B/16 batch 64: the MLP bias gradients, [12608 tokens, features] summed over tokens
    assert sizes(scratch_for(aten.sum.dim_IntList, (meta(12608, 768), [0]), {}, H200)) == [77463552, 24]
    assert sizes(scratch_for(aten.sum.dim_IntList, (meta(12608, 3072), [0]), {}, H200)) == [138412032, 96]
    assert sizes(scratch_for(aten.sum.dim_IntList, (meta(12608, 768, dtype=torch.bfloat16), [0]), {},
                             H200)) == [77463552, 24]
    # llama-style batch 2 x 2048: summed over batch and sequence
    assert sizes(scratch_for(aten.sum.dim_IntList, (meta(2, 2048, 2048), [0, 1]), {}, H200)) == [67108864, 64]


def test_weight_norms_norm_takes_the_staging_buffer_measured_on_the_h200():
    # wav2vec2's positional convolution, weight_norm over all but dim 2 of its [768, 48, 128]
    # weight: norm_except_dim reduces a [36864, 128] view over dim 0; the H200's allocator
    # recorded 37748736 and 4 bytes taken and given back inside the call
    # (benchmarks/results/zoo_traces_h200_2026-12-02/wav2vec2_bf16_b4_seed6.json.gz)
    weight = meta(36864, 128)
    assert sizes(scratch_for(aten.norm.ScalarOpt_dim, (weight, 2, [0]), {}, H200)) == [37748736, 4]
    assert sizes(scratch_for(aten.linalg_vector_norm.default, (weight, 2, [0]), {}, H200)) == [37748736, 4]
    assert scratch_for(aten.norm.ScalarOpt_dim, (meta(4096, 1024), 2, [1]), {}, H200) == []


def test_small_reductions_take_nothing():
    assert scratch_for(aten.sum.dim_IntList, (meta(64, 1000), [0]), {}, H200) == []
    assert scratch_for(aten.sum.dim_IntList, (meta(4096, 1024), [1]), {}, H200) == []


def test_efficient_attention_backward_measured_on_the_h200():
    # B=8, H=16, M=1024, K=64, as the H200's allocator recorded it:
    # fp32 with the output gradient laid out as the forward's output ([B, M, H, K] in memory):
    # the fp32 product grad_out * out, the sum, delta, then the grad_q workspace
    lse = meta(8, 16, 1024)
    go = meta(8, 1024, 16, 64).transpose(1, 2)
    q = meta(8, 16, 1024, 64)
    args = (go, q, q, q, None, go, lse)
    got = scratch_for(aten._scaled_dot_product_efficient_attention_backward.default, args, {}, H200)
    assert [(s.nbytes, s.before_outputs, s.outlives) for s in got] == \
        [(33554432, False, 2), (524288, False, 1), (524288, False, None), (33587200, False, None)]
    # a contiguous [B, H, M, K] gradient is first copied, before the outputs
    got = scratch_for(aten._scaled_dot_product_efficient_attention_backward.default, (q,) + args[1:], {}, H200)
    assert sizes(got) == [33554432, 33554432, 524288, 524288, 33587200]
    assert [s.before_outputs for s in got] == [True, False, False, False, False]
    # bf16: the kernel computes delta itself
    go16 = meta(8, 1024, 16, 64, dtype=torch.bfloat16).transpose(1, 2)
    q16 = meta(8, 16, 1024, 64, dtype=torch.bfloat16)
    got = scratch_for(aten._scaled_dot_product_efficient_attention_backward.default,
                      (go16, q16, q16, q16, None, go16, lse), {}, H200)
    assert sizes(got) == [524288, 33587200]
    # ViT-B/16 batch 64: 197 tokens, the workspace padded to 4 blocks of 64 queries
    q = meta(64, 12, 197, 64)
    got = scratch_for(aten._scaled_dot_product_efficient_attention_backward.default,
                      (q, q, q, q, None, q, meta(64, 12, 224)), {}, H200)
    assert sizes(got)[-1] == 50380800


def test_cudnn_attention_backward_measured_on_the_h200():
    q = meta(64, 12, 197, 64, dtype=torch.bfloat16)
    got = scratch_for(aten._scaled_dot_product_cudnn_attention_backward.default, (q, q, q, q, q, None), {}, H200)
    assert sizes(got) == [39337216]


def test_other_ops_take_nothing():
    assert scratch_for(aten.mm.default, (meta(64, 64), meta(64, 64)), {}, H200) == []


def test_the_estimate_puts_a_bias_gradients_staging_buffer_into_its_run():
    est = estimate(lambda: nn.Linear(768, 3072), None, lambda: torch.randn(12608, 768),
                   lambda m, x: m(x).float().pow(2).mean(), device="cuda", sm90=True)
    run = est.run
    staging = [b for b in run.blocks.values() if b.name == "reduction staging buffer and semaphores"]
    sums = [b for b in staging if b.nbytes == 138412032]
    assert len(sums) == 2                       # one bias gradient per step, two steps
    for b in sums:
        assert b.category == "temporaries" and b.phase == "backward"
        assert b.free_seq is not None and b.free_seq > b.alloc_seq
        assert run.actions[b.alloc_seq] == Action.ALLOC and run.event_blocks[b.alloc_seq] == b.id
        assert run.actions[b.free_seq] == Action.FREE and run.event_blocks[b.free_seq] == b.id
    assert any("kernel scratch" in n for n in est.notes)


def test_the_estimate_puts_weight_norms_staging_buffer_into_its_run_as_the_model_is_built():
    """A convolution under weight_norm, as wav2vec2's positional one: building it computes
    the norm of its weight, and on a GPU the reduction's staging (twice the weight) is taken
    and given back then, before any step."""
    def build():
        conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(768, 768, 128, padding=64, groups=16), dim=2)
        return nn.Sequential(conv)
    est = estimate(build, None, lambda: torch.randn(1, 768, 64), lambda m, x: m(x).float().mean(),
                   device="cuda", sm90=True)
    staging = [b for b in est.run.blocks.values()
               if b.name == "reduction staging buffer and semaphores" and b.nbytes == 37748736]
    assert staging and staging[0].phase not in ("forward", "backward", "optimizer")


# ---------------------------------------------------------------- measured on the GPU (op_probe)

def test_scratch_is_what_a_call_freed_in_order():
    from memdoctor.predict.op_probe import scratch_from_trace
    # convolution_backward as the H200 ran it: grad_input, its workspace, grad_weight, its workspace
    trace = [{"action": "alloc", "addr": 1, "size": 6422528},
             {"action": "alloc", "addr": 2, "size": 32112656},
             {"action": "free_requested", "addr": 2, "size": 32112656},
             {"action": "free_completed", "addr": 2, "size": 32112656},
             {"action": "alloc", "addr": 3, "size": 4194304},
             {"action": "alloc", "addr": 2, "size": 32112656},
             {"action": "free_completed", "addr": 2, "size": 32112656}]
    got = scratch_from_trace(trace)
    assert [(s.nbytes, s.before_outputs, s.outlives) for s in got] == [(32112656, False, 0), (32112656, False, 0)]
    # a copy made before the output and kept until the end, then a workspace
    trace = [{"action": "alloc", "addr": 9, "size": 1000}, {"action": "alloc", "addr": 1, "size": 64},
             {"action": "alloc", "addr": 2, "size": 500}, {"action": "free_completed", "addr": 2, "size": 500},
             {"action": "free_completed", "addr": 9, "size": 1000}]
    got = scratch_from_trace(trace)
    assert [(s.nbytes, s.before_outputs, s.outlives) for s in got] == [(1000, True, None), (500, False, 0)]
    # a C++ temporary that outlives the next two allocations (attention backward's delta in fp32)
    trace = [{"action": "alloc", "addr": 1, "size": 64}, {"action": "alloc", "addr": 2, "size": 4096},
             {"action": "alloc", "addr": 3, "size": 16}, {"action": "alloc", "addr": 4, "size": 16},
             {"action": "free_completed", "addr": 3, "size": 16}, {"action": "free_completed", "addr": 2, "size": 4096},
             {"action": "alloc", "addr": 5, "size": 8192}, {"action": "free_completed", "addr": 5, "size": 8192},
             {"action": "free_completed", "addr": 4, "size": 16}]
    got = scratch_from_trace(trace)
    assert [(s.nbytes, s.outlives) for s in got] == [(4096, 2), (16, 1), (16, None), (8192, 0)]


def test_a_convolution_is_described_by_shapes_never_data():
    from memdoctor.predict.op_probe import spec_of
    x = torch.randn(2, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3)
    key, _ = spec_of((x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {})
    key2, _ = spec_of((torch.zeros(2, 3, 8, 8), w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {})
    key3, _ = spec_of((x.contiguous(memory_format=torch.channels_last), w, None, [1, 1], [1, 1], [1, 1],
                       False, [0, 0], 1), {})
    assert key == key2 and hash(key) == hash(key2)
    assert key != key3                      # another layout: another algorithm, maybe


def test_scratch_freed_at_once_is_freed_before_the_next_in_the_run():
    from memdoctor.cuda.kernel_scratch import Scratch
    from memdoctor.predict.kernel_watch import scratch_events
    class W:
        scratch = [(5, 7, [Scratch(100, "a", outlives=0), Scratch(200, "b", outlives=0), Scratch(50, "c")])]
    events = scratch_events(W())
    assert [(e[0], e[1], e[3]) for e in events] == [(7, "alloc", 100), (7, "free", 0), (7, "alloc", 200),
                                                    (7, "free", 0), (7, "alloc", 50), (7, "free", 0)]


def test_scratch_freed_after_what_it_outlives():
    from memdoctor.cuda.kernel_scratch import Scratch
    from memdoctor.predict.kernel_watch import scratch_events
    class W:    # fp32 attention backward's delta: product, sum, delta, then the workspace
        scratch = [(5, 7, [Scratch(4096, "product", outlives=2), Scratch(16, "sum", outlives=1),
                           Scratch(16, "delta"), Scratch(8192, "workspace", outlives=0)])]
    events = scratch_events(W())
    got = [(e[1], e[2][1]) for e in events]
    assert got == [("alloc", 0), ("alloc", 1), ("alloc", 2), ("free", 1), ("free", 0),
                   ("alloc", 3), ("free", 3), ("free", 2)]


def test_embedding_backward_measured_on_the_h200():
    # GPT-2 355M batch 8 x 1024 tokens: the token embedding (50257 rows of 1024)
    g = meta(8, 1024, 1024)
    idx = meta(8, 1024, dtype=torch.long)
    got = scratch_for(aten.embedding_dense_backward.default, (g, idx, 50257, -1, False), {}, H200)
    measured = [65536, 65536, 65536, 65536, 8, 65536, 1279, 65536, 65536, 1279, 8, 72088, 36909056]
    assert sorted(s.nbytes for s in got if "cub sort" not in s.label) == sorted(measured)
    # llama-style batch 2 x 2048 over 128256 rows of 2048: 4505 partial segments
    got = scratch_for(aten.embedding_dense_backward.default, (meta(2, 2048, 2048), meta(2, 2048, dtype=torch.long),
                                                              128256, -1, False), {}, H200)
    assert got[-1].nbytes == 36904960 and got[-2].nbytes == 36040
    # BERT-base batch 32 x 512: the token types, 16384 indices into 2 rows: segments are rows,
    # not indices (16-byte allocations), partial segments 16384 // 10 + 2
    got = scratch_for(aten.embedding_dense_backward.default, (meta(32, 512, 768), meta(32, 512, dtype=torch.long),
                                                              2, -1, False), {}, H200)
    sizes_ = [s.nbytes for s in got if "cub" not in s.label]
    assert sizes_.count(16) == 2 and sizes_.count(131072) == 5 and 13120 in sizes_
    # and the words: 16384 // 10 + 16384 partial segments of 768 fp32
    got = scratch_for(aten.embedding_dense_backward.default, (meta(32, 512, 768), meta(32, 512, dtype=torch.long),
                                                              30522, -1, False), {}, H200)
    assert got[-1].nbytes == 55363584 and got[-2].nbytes == 144176
    # positions (1024 indices): the sort-free kernel
    assert scratch_for(aten.embedding_dense_backward.default, (meta(1024, 1024), meta(1024, dtype=torch.long),
                                                               1024, -1, False), {}, H200) == []


def test_layer_norm_of_a_transposed_input_copies_it_as_on_the_h200():
    # Whisper's encoder, batch 4: hidden states [4, 1500, 512] laid out as the convolutions'
    # [4, 512, 1500] output. The H200 allocated a 12288000-byte copy before the output (and
    # before mean and rstd) and freed it after them; in backward before dX, dgamma and dbeta.
    x = meta(4, 512, 1500).transpose(1, 2)
    w = meta(512)
    got = scratch_for(aten.native_layer_norm.default, (x, [512], w, w, 1e-5), {}, H200)
    assert [(s.nbytes, s.before_outputs, s.outlives) for s in got] == [(12288000, True, None)]
    mean = meta(4, 1500, 1)
    dy = meta(4, 1500, 512)
    got = scratch_for(aten.native_layer_norm_backward.default, (dy, x, [512], mean, mean, w, w, [True, True, True]),
                      {}, H200)
    assert [(s.nbytes, s.before_outputs, s.outlives) for s in got] == [(12288000, True, None)]
    # a transposed output gradient is made contiguous too, after the outputs
    got = scratch_for(aten.native_layer_norm_backward.default,
                      (meta(4, 512, 1500).transpose(1, 2), dy, [512], mean, mean, w, w, [True, True, True]), {}, H200)
    assert [(s.nbytes, s.before_outputs) for s in got] == [(12288000, False)]
    # contiguous inputs: nothing
    assert scratch_for(aten.native_layer_norm.default, (dy, [512], w, w, 1e-5), {}, H200) == []
    assert scratch_for(aten.native_layer_norm_backward.default, (dy, dy, [512], mean, mean, w, w, [True, True, True]),
                       {}, H200) == []


def test_softmax_of_a_channels_last_input_copies_it_as_on_the_h200():
    # SegFormer fp32 batch 16 on the H200: the cross-entropy's log-softmax over the classes of
    # the upsampled channels-last logits [16, 150, 512, 512] copied them (2516582400 bytes)
    # after its output, and freed the copy when it returned
    logits = meta(16, 512, 512, 150).permute(0, 3, 1, 2)
    assert not logits.is_contiguous()
    got = scratch_for(aten._log_softmax.default, (logits, 1, False), {}, H200)
    assert [(s.nbytes, s.before_outputs, s.outlives) for s in got] == [(2516582400, False, None)]
    assert sizes(scratch_for(aten._softmax.default, (meta(8, 64, 64, 32).permute(0, 3, 1, 2), 1, False), {},
                             H200)) == [8 * 64 * 64 * 32 * 4]
    assert scratch_for(aten._log_softmax.default, (meta(16, 150, 64, 64), 1, False), {}, H200) == []
    assert scratch_for(aten._softmax.default, (meta(8, 1024), -1, False), {}, H200) == []


def test_the_estimate_copies_channels_last_logits_for_the_cross_entropy():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 10)

        def forward(self, x):           # [N, H*W, C] tokens to channels-last [N, classes, H, W] logits
            return self.lin(x).permute(0, 2, 1).reshape(4, 10, 16, 16)

    est = estimate(Head, None, lambda: (torch.randn(4, 256, 32), torch.randint(0, 10, (4, 16, 16))),
                   lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), device="cuda")
    run = est.run
    copies = [b for b in run.blocks.values() if b.name == "softmax: contiguous copy of the input"]
    assert len(copies) == 2 and {b.nbytes for b in copies} == {4 * 10 * 16 * 16 * 4}
    for b in copies:
        made = run.blocks[run.event_blocks[b.alloc_seq - 1]]
        assert made.name == "aten._log_softmax" and b.free_seq == b.alloc_seq + 1


def _plain_cpu_allocations(fn) -> list[int]:
    """The sizes a plain CPU call allocates, in order (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    return [e.nbytes() for e in events if e.nbytes() > 0]


def test_roll_over_two_dims_makes_an_intermediate_as_the_kernels_do():
    # roll_common rolls one dimension at a time on CUDA and the CPU alike: Swin's cyclic
    # shift (two dims) makes a full-size intermediate before its output (the H200's trace of
    # swin/ckpt/b64: 73.5 MiB twice per shift, the first freed after the output is made)
    x = torch.randn(8, 56, 56, 96)
    nbytes = x.numel() * 4
    plain = _plain_cpu_allocations(lambda: torch.roll(x, (-3, -3), (1, 2)))
    assert plain == [nbytes, nbytes]
    scratch = scratch_for(aten.roll.default, (meta(8, 56, 56, 96), [-3, -3], [1, 2]), {}, H200)
    assert [(s.nbytes, s.before_outputs, s.outlives) for s in scratch] == [(nbytes, True, None)]
    # one dimension of a contiguous input: the output alone; a transposed input: a copy first
    assert scratch_for(aten.roll.default, (meta(8, 56, 56, 96), [3], [1]), {}, H200) == []
    # (the CPU's one-dimension roll concatenates two narrows of any layout: intermediate and
    # output only; CUDA's roll_cuda makes the input contiguous first)
    y = torch.randn(8, 96, 56, 56).transpose(1, 3)
    assert _plain_cpu_allocations(lambda: torch.roll(y, (3, 3), (1, 2))) == [nbytes] * 2
    scratch = scratch_for(aten.roll.default, (meta(8, 96, 56, 56).transpose(1, 3), [3, 3], [1, 2]), {}, H200)
    assert [(s.nbytes, s.before_outputs, s.outlives) for s in scratch] == [(nbytes, True, 1), (nbytes, True, None)]


def test_topk_of_a_column_slice_copies_it_as_on_the_h200():
    # Faster R-CNN bf16 batch 8 on the H200: the RPN's topk (k = 2000) of the objectness
    # scores of each feature level, a column slice of [8, 21285], allocated 150000 and 40560
    # bytes after its values and indices, and freed them when it returned
    scores = meta(8, 21285, dtype=torch.bfloat16)
    got = [scratch_for(aten.topk.default, (scores[:, start:start + n], 2000, 1), {}, H200)
           for start, n in ((0, 9375), (9375, 9375), (18750, 2535))]
    assert [[(s.nbytes, s.before_outputs) for s in g] for g in got] == [[(150000, False)], [(150000, False)],
                                                                         [(40560, False)]]
    assert scratch_for(aten.topk.default, (meta(8, 9375), 2000, 1), {}, H200) == []        # contiguous
    # a few slices of 100,000 elements or more are sorted whole: not this path
    assert scratch_for(aten.topk.default, (meta(200000, 4).t(), 10, 1), {}, H200) == []


def test_indexing_with_index_tensors_of_different_strides_copies_them_as_on_the_h200():
    # Faster R-CNN bf16 batch 8 on the H200: objectness[batch_idx, top_n_idx] with batch_idx
    # [8, 1] and top_n_idx [8, 6000] made a 384000-byte copy of batch_idx broadcast, then its
    # output
    x = meta(8, 21285, dtype=torch.bfloat16)
    batch_idx = torch.arange(8, device="meta")[:, None]
    top_n_idx = torch.empty(8, 6000, dtype=torch.int64, device="meta")
    got = scratch_for(aten.index.Tensor, (x, [batch_idx, top_n_idx]), {}, H200)
    assert [(s.nbytes, s.before_outputs) for s in got] == [(384000, True)]
    rows, cols = (torch.empty(500, dtype=torch.int64, device="meta") for _ in range(2))
    assert scratch_for(aten.index.Tensor, (x, [rows, cols]), {}, H200) == []        # strides alike
    assert scratch_for(aten.index.Tensor, (x, [None, cols]), {}, H200) == []        # one index tensor


def test_an_ops_scratch_after_its_outputs_comes_before_the_next_ops_scratch():
    """The layer norm after a convolution copies its input at the index where the
    convolution ended; the convolution's workspace after its outputs is measured later and
    joins the list last, but the GPU makes it first (the H200's trace of Data2Vec-Audio,
    benchmarks/results/holdout_traces_h200_2026-12-03)."""
    from memdoctor.cuda.kernel_scratch import Scratch
    from memdoctor.predict.kernel_watch import scratch_events

    class W:
        scratch = [(10, 12, [Scratch(250, "layer norm copy", before_outputs=True, outlives=None)]),
                   (5, 10, [Scratch(500, "workspace", before_outputs=True, outlives=0),
                            Scratch(760, "workspace after", outlives=0)])]
    events = scratch_events(W())
    allocs = [(e[0], e[3]) for e in sorted(events, key=lambda e: e[0]) if e[1] == "alloc"]
    assert allocs == [(5, 500), (10, 760), (10, 250)]
