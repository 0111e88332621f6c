"""A second zoo, held out: architectures of kinds the first zoo (zoo_models.py) has, and of
kinds it has not, that memdoctor's rules were never checked against while they were built.
It is measured the same way (`benchmarks/zoo_accuracy.py --set holdout`) to see whether the
estimate holds for the kind of model and not only for the models it was measured on.

Random weights, configurations written here (no downloads); transformers models need
transformers, the rest is plain torch. Sizes are cut down as in zoo_models.py.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from zoo_models import Arch, _ctc_inputs, _decoder, _hf, _hf_loss, _images, _seq2seq, _tokens

__all__ = ["holdout"]


def _no_mask(vocab: int, seq: int) -> Callable[[int], dict]:
    """Tokens and labels, no attention mask (FNet takes none)."""
    def inputs(n: int) -> dict:
        ids = torch.randint(0, vocab, (n, seq))
        return {"input_ids": ids, "labels": ids.clone()}
    return inputs


def _spectrogram_inputs(n: int) -> dict:
    """The Audio Spectrogram Transformer's 1024 frames x 128 mel bins, 35 classes."""
    return {"input_values": torch.randn(n, 1024, 128), "labels": torch.randint(0, 35, (n,))}


def _siglip_inputs(n: int) -> dict:
    return {"input_ids": torch.randint(0, 32000, (n, 64)), "pixel_values": torch.randn(n, 3, 224, 224),
            "return_loss": True}


def _upernet_inputs(n: int) -> dict:
    return {"pixel_values": torch.randn(n, 3, 512, 512), "labels": torch.randint(0, 150, (n, 512, 512))}


def _transformers_holdout() -> list[Arch]:
    rope = {"max_position_embeddings": 2048}
    return [
        _decoder("gpt-neo", "GPTNeoForCausalLM", "GPTNeoConfig", 50257, 1024, (4, 8), hidden_size=768,
                 num_layers=4, num_heads=12, attention_types=[[["global", "local"], 2]], window_size=256,
                 max_position_embeddings=2048),                                        # local / global layers
        _decoder("gptj", "GPTJForCausalLM", "GPTJConfig", 50400, 1024, (4, 8), n_embd=1024, n_layer=4, n_head=16,
                 rotary_dim=64, n_positions=2048),                                     # interleaved rotary, parallel
        _decoder("phi3", "Phi3ForCausalLM", "Phi3Config", 32064, 1024, (4, 8), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                 pad_token_id=0, **rope),                                              # fused qkv and gate/up
        _decoder("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", 49152, 1024, (4, 8),
                 num_hidden_layers=4, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                 num_key_value_heads=4, sliding_window=512, **rope),                   # GQA, window, biases
        _decoder("cohere", "CohereForCausalLM", "CohereConfig", 256000, 1024, (2, 4), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                 logit_scale=0.0625, tie_word_embeddings=True, **rope),               # scaled tied logits, 256k
        _decoder("mamba", "MambaForCausalLM", "MambaConfig", 50280, 512, (4, 8), family="recurrent",
                 hidden_size=768, num_hidden_layers=4, state_size=16, expand=2,
                 conv_kernel=4),                                                       # selective scan, torch loop
        _decoder("qwen3-moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", 32000, 512, (4, 8), family="moe",
                 num_hidden_layers=4, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512,
                 num_attention_heads=8, num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, **rope),
        Arch("switch", "moe", _hf("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig",
                                  vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=4,
                                  num_decoder_layers=4, num_heads=8, num_experts=8, expert_capacity=64,
                                  decoder_start_token_id=0, pad_token_id=0),
             _seq2seq(32128, 512, 128), _hf_loss, (4, 8)),                             # capacity-limited routing
        Arch("pegasus", "encoder-decoder", _hf("PegasusForConditionalGeneration", "PegasusConfig",
                                               vocab_size=96103, d_model=768, encoder_layers=3, decoder_layers=3,
                                               encoder_attention_heads=12, decoder_attention_heads=12,
                                               encoder_ffn_dim=3072, decoder_ffn_dim=3072),
             _seq2seq(96103, 512, 128), _hf_loss, (8, 16)),                            # sinusoidal, 96k vocab
        Arch("xlnet", "encoder", _hf("XLNetLMHeadModel", "XLNetConfig", vocab_size=32000, d_model=768, n_layer=4,
                                     n_head=12, d_inner=3072),
             _tokens(32000, 512), _hf_loss, (4, 8)),                                   # relative two-stream attention
        Arch("funnel", "encoder", _hf("FunnelForMaskedLM", "FunnelConfig", vocab_size=30522, block_sizes=[2, 2, 2],
                                      d_model=768, n_head=12, d_inner=3072),
             _tokens(30522, 512), _hf_loss, (8, 16)),                                  # pooled sequence, upsampled
        Arch("mpnet", "encoder", _hf("MPNetForMaskedLM", "MPNetConfig", vocab_size=30527, hidden_size=768,
                                     num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072,
                                     max_position_embeddings=514),
             _tokens(30527, 512, pad_tail=32), _hf_loss, (8, 16)),                     # relative position buckets
        Arch("fnet", "encoder", _hf("FNetForMaskedLM", "FNetConfig", vocab_size=32000, hidden_size=768,
                                    num_hidden_layers=6, intermediate_size=3072, max_position_embeddings=512),
             _no_mask(32000, 512), _hf_loss, (8, 16)),                                 # FFT instead of attention
        Arch("deit", "vision", _hf("DeiTForImageClassification", "DeiTConfig", hidden_size=768,
                                   num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072,
                                   image_size=224, patch_size=16, num_labels=1000),
             _images(224, 1000), _hf_loss, (32, 64)),
        Arch("swinv2", "vision", _hf("Swinv2ForImageClassification", "Swinv2Config", image_size=256, embed_dim=96,
                                     depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24], window_size=8,
                                     num_labels=1000),
             _images(256, 1000), _hf_loss, (32, 64)),                                  # cosine attention, log-CPB
        Arch("levit", "vision", _hf("LevitForImageClassification", "LevitConfig", num_labels=1000),
             _images(224, 1000), _hf_loss, (64, 128)),                                 # BatchNorm'd attention
        Arch("pvt-v2", "vision", _hf("PvtV2ForImageClassification", "PvtV2Config", num_labels=1000),
             _images(224, 1000), _hf_loss, (32, 64)),                                  # spatial-reduction attention
        Arch("regnet", "vision", _hf("RegNetForImageClassification", "RegNetConfig", num_labels=1000),
             _images(224, 1000), _hf_loss, (64, 128)),                                 # grouped convolutions
        Arch("upernet", "segmentation", _hf("UperNetForSemanticSegmentation", "UperNetConfig", num_labels=150,
                                            backbone_config={"model_type": "convnext", "depths": [2, 2, 6, 2],
                                                             "hidden_sizes": [96, 192, 384, 768],
                                                             "out_features": ["stage1", "stage2", "stage3",
                                                                              "stage4"]}),
             _upernet_inputs, _hf_loss, (4, 8)),                                       # pyramid pooling, FPN
        Arch("wavlm", "speech", _hf("WavLMForCTC", "WavLMConfig", vocab_size=32, hidden_size=768,
                                    num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072,
                                    ctc_loss_reduction="mean", mask_time_prob=0.0, layerdrop=0.0),
             _ctc_inputs, _hf_loss, (4, 8)),                                           # gated relative position bias
        Arch("data2vec-audio", "speech", _hf("Data2VecAudioForCTC", "Data2VecAudioConfig", vocab_size=32,
                                             hidden_size=768, num_hidden_layers=4, num_attention_heads=12,
                                             intermediate_size=3072, ctc_loss_reduction="mean",
                                             mask_time_prob=0.0, layerdrop=0.0),
             _ctc_inputs, _hf_loss, (4, 8)),                                           # convolutional positions
        Arch("ast", "speech", _hf("ASTForAudioClassification", "ASTConfig", hidden_size=768, num_hidden_layers=6,
                                  num_attention_heads=12, intermediate_size=3072, num_labels=35),
             _spectrogram_inputs, _hf_loss, (16, 32)),                                 # spectrogram patches
        Arch("siglip", "contrastive", _hf("SiglipModel", "SiglipConfig",
                                          text_config={"vocab_size": 32000, "hidden_size": 768,
                                                       "num_hidden_layers": 4, "num_attention_heads": 12,
                                                       "intermediate_size": 3072, "max_position_embeddings": 64},
                                          vision_config={"hidden_size": 768, "num_hidden_layers": 6,
                                                         "num_attention_heads": 12, "intermediate_size": 3072,
                                                         "image_size": 224, "patch_size": 16}),
             _siglip_inputs, _hf_loss, (32, 64)),                                      # sigmoid pairwise loss
    ]


# ----------------------------------------------------------------------- plain torch
class Seq2SeqTransformer(nn.Module):
    """torch's nn.Transformer, encoder and decoder, with padding and causal masks."""

    def __init__(self, vocab: int = 32000, dim: int = 512, heads: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1024, dim))
        self.transformer = nn.Transformer(dim, heads, layers, layers, 4 * dim, dropout=0.1, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        out = self.transformer(self.embed(src) + self.pos[:src.shape[1]], self.embed(tgt) + self.pos[:tgt.shape[1]],
                               tgt_mask=causal, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad,
                               tgt_is_causal=True)
        return self.head(out)


def _translation_inputs(n: int) -> dict:
    src = torch.randint(0, 32000, (n, 512))
    pad = torch.zeros(n, 512, dtype=torch.bool)
    pad[:, 448:] = True
    tgt = torch.randint(0, 32000, (n, 257))
    return {"src": src, "src_pad": pad, "tgt": tgt}


def _translation_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    tgt = batch["tgt"]
    logits = model(batch["src"], tgt[:, :-1], batch["src_pad"])
    return F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())


class PackedLSTMTagger(nn.Module):
    """A bidirectional LSTM over sentences of different lengths, packed as NLP scripts do
    (pack_padded_sequence: the packed batch's shape comes from the lengths)."""

    def __init__(self, vocab: int = 50000, dim: int = 512, tags: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.rnn = nn.LSTM(dim, dim, num_layers=2, batch_first=True, bidirectional=True, dropout=0.1)
        self.head = nn.Linear(2 * dim, tags)
        self.checkpointing = False

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.checkpointing = True

    def _recurrent(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])[0]

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.checkpointing and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(self._recurrent, x, lengths, use_reentrant=False)
        else:
            out = self._recurrent(x, lengths)
        return self.head(out)


def _tagging_inputs(n: int) -> dict:
    """Sentences of 64 to 256 tokens, drawn on the CPU by a seeded generator (lengths stay
    there, as pack_padded_sequence wants), ids and tags then on the default device."""
    g = torch.Generator(device="cpu").manual_seed(n)
    lengths = torch.randint(64, 257, (n,), generator=g, device="cpu")
    lengths[0] = 256
    ids = torch.randint(1, 50000, (n, 256), generator=g, device="cpu")
    ids[torch.arange(256, device="cpu")[None] >= lengths[:, None]] = 0
    tags = torch.randint(0, 64, (n, 256), generator=g, device="cpu")
    device = torch.get_default_device()
    return {"ids": ids.to(device), "lengths": lengths, "tags": tags.to(device)}


def _tagging_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["ids"], batch["lengths"].cpu())
    tags = batch["tags"].masked_fill(batch["ids"] == 0, -100)
    return F.cross_entropy(logits.flatten(0, 1), tags.flatten(), ignore_index=-100)


class Recommender(nn.Module):
    """DLRM-like: sparse features through EmbeddingBag tables (mean of a bag of ids each),
    dense features through an MLP, their pairwise dot products into a top MLP."""

    def __init__(self, tables: int = 8, rows: int = 200_000, dim: int = 128, dense: int = 13) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="mean") for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(dense, 512), nn.ReLU(), nn.Linear(512, dim), nn.ReLU())
        pairs = (tables + 1) * tables // 2
        self.top = nn.Sequential(nn.Linear(pairs + dim, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                 nn.Linear(1024, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        feats = torch.stack([x] + [t(ids[:, i]) for i, t in enumerate(self.tables)], dim=1)
        inter = feats @ feats.transpose(1, 2)
        i, j = torch.triu_indices(feats.shape[1], feats.shape[1], offset=1, device=feats.device)
        return self.top(torch.cat([x, inter[:, i, j]], dim=1)).squeeze(1)


def _recsys_inputs(n: int) -> dict:
    return {"dense": torch.randn(n, 13), "ids": torch.randint(0, 200_000, (n, 8, 20)),
            "clicks": torch.randint(0, 2, (n,)).float()}


def _recsys_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(batch["dense"], batch["ids"]), batch["clicks"])


class WaveNet(nn.Module):
    """Dilated causal 1-D convolutions with gated activations and skip connections."""

    def __init__(self, channels: int = 128, layers: int = 20, classes: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(classes, channels)
        self.filters = nn.ModuleList(nn.Conv1d(channels, 2 * channels, 2, dilation=2 ** (i % 10))
                                     for i in range(layers))
        self.res = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in range(layers))
        self.skip = nn.ModuleList(nn.Conv1d(channels, 256, 1) for _ in range(layers))
        self.out = nn.Sequential(nn.ReLU(), nn.Conv1d(256, 256, 1), nn.ReLU(), nn.Conv1d(256, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(1, 2)
        skips = 0
        for f, r, s in zip(self.filters, self.res, self.skip):
            d = f.dilation[0]
            a, b = f(F.pad(h, (d, 0))).chunk(2, dim=1)
            z = torch.tanh(a) * torch.sigmoid(b)
            skips = skips + s(z)
            h = h + r(z)
        return self.out(skips)


def _audio_sample_inputs(n: int) -> dict:
    return {"x": torch.randint(0, 256, (n, 16000))}


def _wavenet_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    x = batch["x"]
    return F.cross_entropy(model(x[:, :-1]), x[:, 1:])


def _torch_holdout() -> list[Arch]:
    return [
        Arch("torch-seq2seq", "encoder-decoder", Seq2SeqTransformer, _translation_inputs, _translation_loss, (8, 16),
             source="torch"),
        Arch("packed-lstm", "rnn", PackedLSTMTagger, _tagging_inputs, _tagging_loss, (32, 64), "model", "torch"),
        Arch("recsys", "recommender", Recommender, _recsys_inputs, _recsys_loss, (2048, 4096), "none", "torch"),
        Arch("wavenet", "audio", WaveNet, _audio_sample_inputs, _wavenet_loss, (8, 16), "none", "torch"),
    ]


def holdout() -> list[Arch]:
    archs: list[Arch] = []
    try:
        import transformers  # noqa: F401
        archs += _transformers_holdout()
    except ImportError:
        pass
    return archs + _torch_holdout()
