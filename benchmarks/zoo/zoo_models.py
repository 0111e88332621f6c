"""A zoo of architectures memdoctor's code was never shaped for: one builder each, random
weights, configurations written here (no downloads), independent of memdoctor.

    from zoo_models import ZOO, build
    model, optimizer, batch, loss_fn = build("llama", batch=4)            # on the default device
    model, optimizer, batch, loss_fn = build("lstm", batch=16, own_checkpointing=True)

Each Arch makes the model (`make()`), a batch of `n` samples (`inputs(n)`, a dict of tensors
on the default device, as a data loader and tokenizer give them: attention masks included)
and the mean loss (`loss(model, batch)`). `batches` are the two batch sizes measured.
`checkpointing` says how full activation checkpointing is applied: "plan" (a generic
block-wrapping remedy such as memdoctor's ckpt=full finds the repeated blocks), "model" (the
model's own gradient_checkpointing_enable(): the RNN language models', around the recurrent
stack) or "none" (ALBERT: one layer shared by all blocks, which neither can wrap).

Sizes are cut down (few layers) so that an estimate takes seconds, with the real models'
widths, vocabularies and sequence lengths so that the memory is theirs in kind; the largest
configuration stays under ~13 GiB on a GPU. transformers models need transformers;
torchvision's are in the zoo only where torchvision imports; the rest is plain torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

__all__ = ["Arch", "ZOO", "build", "names"]


@dataclass
class Arch:
    """One architecture: how to build it, its batch and its loss."""
    name: str
    family: str                                  # decoder, moe, encoder-decoder, encoder, vision, speech, rnn, ...
    make: Callable[[], nn.Module]
    inputs: Callable[[int], dict]
    loss: Callable[[nn.Module, dict], torch.Tensor]
    batches: tuple[int, int]
    checkpointing: str = "plan"                  # "plan", "model" or "none"
    source: str = "transformers"                 # transformers, torchvision, torch
    held_out: bool = False                       # from holdout_models.py: measured apart (--set holdout)


def _hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """transformers models compute their own loss from `labels`."""
    return model(**batch).loss


def _classifier_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])


# ----------------------------------------------------------------------- batches
def _tokens(vocab: int, seq: int, labels: bool = True, pad_tail: int = 0) -> Callable[[int], dict]:
    """input_ids, an attention mask (the last `pad_tail` positions padding) and labels."""
    def inputs(n: int) -> dict:
        ids = torch.randint(0, vocab, (n, seq))
        mask = torch.ones(n, seq, dtype=torch.long)
        if pad_tail:
            mask[:, seq - pad_tail:] = 0
        out = {"input_ids": ids, "attention_mask": mask}
        if labels:
            out["labels"] = ids.masked_fill(mask == 0, -100)
        return out
    return inputs


def _seq2seq(vocab: int, src: int, tgt: int) -> Callable[[int], dict]:
    def inputs(n: int) -> dict:
        return {"input_ids": torch.randint(0, vocab, (n, src)),
                "attention_mask": torch.ones(n, src, dtype=torch.long),
                "labels": torch.randint(0, vocab, (n, tgt))}
    return inputs


def _images(size: int, classes: int) -> Callable[[int], dict]:
    def inputs(n: int) -> dict:
        return {"pixel_values": torch.randn(n, 3, size, size), "labels": torch.randint(0, classes, (n,))}
    return inputs


# ----------------------------------------------------------------------- transformers
def _hf(model_class: str, config_class: str, auto: bool = False, **config) -> Callable[[], nn.Module]:
    """A transformers model of `model_class` from a config written here, random weights."""
    def make() -> nn.Module:
        import transformers
        cfg = getattr(transformers, config_class)(**config)
        return getattr(transformers, model_class)(cfg) if not auto else \
            getattr(transformers, model_class).from_config(cfg)
    return make


def _decoder(name: str, model_class: str, config_class: str, vocab: int, seq: int, batches: tuple[int, int],
             family: str = "decoder", checkpointing: str = "plan", **config) -> Arch:
    return Arch(name, family, _hf(model_class, config_class, vocab_size=vocab, **config), _tokens(vocab, seq),
                _hf_loss, batches, checkpointing)


def _transformers_zoo() -> list[Arch]:
    rope = {"max_position_embeddings": 2048}
    return [
        # decoder LMs, one of each attention family
        _decoder("gpt2", "GPT2LMHeadModel", "GPT2Config", 50257, 1024, (4, 8),
                 n_layer=6, n_embd=768, n_head=12, n_positions=1024),                         # MHA, learned positions
        _decoder("llama", "LlamaForCausalLM", "LlamaConfig", 32000, 1024, (4, 8), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                 **rope),                                                                      # GQA 16/4, rotary
        _decoder("qwen2", "Qwen2ForCausalLM", "Qwen2Config", 151936, 1024, (2, 4), num_hidden_layers=4,
                 hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                 tie_word_embeddings=True, **rope),                                            # GQA 14/2, tied, 152k vocab
        _decoder("qwen3", "Qwen3ForCausalLM", "Qwen3Config", 151936, 1024, (2, 4), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, tie_word_embeddings=True, **rope),                              # GQA, q/k norms
        _decoder("falcon", "FalconForCausalLM", "FalconConfig", 65024, 1024, (4, 8), num_hidden_layers=4,
                 hidden_size=1024, num_attention_heads=16, multi_query=True, new_decoder_architecture=False,
                 parallel_attn=True, bias=False, alibi=False),                                 # MQA, parallel attention
        _decoder("gpt-bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", 49152, 1024, (2, 4),
                 n_layer=4, n_embd=1024, n_head=16, n_positions=2048, multi_query=True),       # MQA
        _decoder("gpt-neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", 50304, 1024, (4, 8), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=4096, num_attention_heads=16, rotary_pct=0.25,
                 use_parallel_residual=True, **rope),                                          # Pythia: partial rotary
        _decoder("bloom", "BloomForCausalLM", "BloomConfig", 65536, 1024, (2, 4), n_layer=4, hidden_size=1024,
                 n_head=16),                                                                   # ALiBi
        _decoder("mistral", "MistralForCausalLM", "MistralConfig", 32000, 1024, (4, 8), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=3584, num_attention_heads=16, num_key_value_heads=4,
                 sliding_window=256, **rope),                                                  # sliding window < seq
        _decoder("opt", "OPTForCausalLM", "OPTConfig", 50272, 1024, (4, 8), num_hidden_layers=4,
                 hidden_size=1024, ffn_dim=4096, num_attention_heads=16, max_position_embeddings=2048,
                 word_embed_proj_dim=1024),                                                    # learned positions from the mask
        _decoder("phi", "PhiForCausalLM", "PhiConfig", 51200, 1024, (4, 8), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=4096, num_attention_heads=16, partial_rotary_factor=0.5,
                 **rope),                                                                      # parallel block, partial rotary
        _decoder("gemma", "GemmaForCausalLM", "GemmaConfig", 64000, 1024, (2, 4), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=1,
                 head_dim=256, **rope),                                                        # MQA, head dim 256
        _decoder("stablelm", "StableLmForCausalLM", "StableLmConfig", 50304, 1024, (4, 8), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16,
                 partial_rotary_factor=0.25, **rope),                                          # LayerNorm, partial rotary
        _decoder("xglm", "XGLMForCausalLM", "XGLMConfig", 256008, 1024, (2, 4), num_layers=4, d_model=1024,
                 attention_heads=16, ffn_dim=4096, max_position_embeddings=2048),          # sinusoidal positions, 256k vocab
        _decoder("gemma2", "Gemma2ForCausalLM", "Gemma2Config", 256000, 1024, (2, 4), num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=256, sliding_window=512, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 query_pre_attn_scalar=256, **rope),                                           # soft-capped logits, local/global
        _decoder("recurrent-gemma", "RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", 256000, 1024, (2, 4),
                 family="recurrent", num_hidden_layers=3, hidden_size=1024, intermediate_size=3072,
                 num_attention_heads=8, lru_width=1024, attention_window_size=512),            # Griffin: RG-LRU scan
        # mixture of experts: routing decides which tokens each expert sees
        _decoder("mixtral", "MixtralForCausalLM", "MixtralConfig", 32000, 512, (4, 8), family="moe",
                 num_hidden_layers=4, hidden_size=512, intermediate_size=1792, num_attention_heads=8,
                 num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, **rope),
        _decoder("qwen2-moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", 32000, 512, (4, 8), family="moe",
                 num_hidden_layers=4, hidden_size=512, intermediate_size=1408, moe_intermediate_size=512,
                 shared_expert_intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8,
                 num_experts=16, num_experts_per_tok=4, experts_implementation="eager", **rope),  # routing loop
        _decoder("olmoe", "OlmoeForCausalLM", "OlmoeConfig", 50304, 512, (4, 8), family="moe", num_hidden_layers=4,
                 hidden_size=1024, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16,
                 num_experts=16, num_experts_per_tok=4, **rope),                               # q/k norms, top-4 of 16
        _decoder("deepseek-v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", 32000, 512, (4, 8), family="moe",
                 num_hidden_layers=4, first_k_dense_replace=1, hidden_size=1024, intermediate_size=2816,
                 moe_intermediate_size=512, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
                 kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=16,
                 num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2, **rope),  # MLA, grouped routing
        # encoder-decoders
        Arch("t5", "encoder-decoder", _hf("T5ForConditionalGeneration", "T5Config", vocab_size=32128, d_model=512, decoder_start_token_id=0, pad_token_id=0,
                                         d_kv=64, d_ff=2048, num_layers=4, num_heads=8),
             _seq2seq(32128, 512, 128), _hf_loss, (8, 16)),
        Arch("bart", "encoder-decoder", _hf("BartForConditionalGeneration", "BartConfig", vocab_size=50265,
                                           d_model=768, encoder_layers=3, decoder_layers=3,
                                           encoder_attention_heads=12, decoder_attention_heads=12,
                                           encoder_ffn_dim=3072, decoder_ffn_dim=3072),
             _seq2seq(50265, 512, 128), _hf_loss, (8, 16)),
        Arch("whisper", "encoder-decoder", _hf("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=51865,
                                              d_model=512, encoder_layers=4, decoder_layers=4,
                                              encoder_attention_heads=8, decoder_attention_heads=8,
                                              encoder_ffn_dim=2048, decoder_ffn_dim=2048, num_mel_bins=80),
             _whisper_inputs, _hf_loss, (4, 8)),
        # encoders
        Arch("bert", "encoder", _hf("BertForMaskedLM", "BertConfig", vocab_size=30522, hidden_size=768,
                                   num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072),
             _tokens(30522, 512, pad_tail=64), _hf_loss, (8, 16)),
        Arch("roberta", "encoder", _hf("RobertaForMaskedLM", "RobertaConfig", vocab_size=50265, hidden_size=768,
                                      num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072,
                                      max_position_embeddings=514),
             _tokens(50265, 512), _hf_loss, (8, 16)),
        Arch("deberta-v2", "encoder", _hf("DebertaV2ForMaskedLM", "DebertaV2Config", vocab_size=128100,
                                         hidden_size=768, num_hidden_layers=4, num_attention_heads=12,
                                         intermediate_size=3072, relative_attention=True, position_buckets=256,
                                         pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                                         position_biased_input=False, norm_rel_ebd="layer_norm",
                                         share_att_key=True),
             _tokens(128100, 512), _hf_loss, (4, 8)),
        Arch("distilbert", "encoder", _hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=30522, dim=768,
                                         n_layers=6, n_heads=12, hidden_dim=3072),
             _tokens(30522, 512, pad_tail=32), _hf_loss, (8, 16)),
        Arch("albert", "encoder", _hf("AlbertForMaskedLM", "AlbertConfig", vocab_size=30000, embedding_size=128,
                                     hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                                     intermediate_size=3072),
             _tokens(30000, 512), _hf_loss, (8, 16), checkpointing="none"),          # one layer shared by all: no ckpt
        Arch("electra", "encoder", _hf("ElectraForMaskedLM", "ElectraConfig", vocab_size=30522, embedding_size=256,
                                      hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                                      intermediate_size=1024),
             _tokens(30522, 512), _hf_loss, (16, 32)),
        Arch("modernbert", "encoder", _hf("ModernBertForMaskedLM", "ModernBertConfig", vocab_size=50368,
                                         hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                                         intermediate_size=1152, global_attn_every_n_layers=3, local_attention=128),
             _tokens(50368, 1024, pad_tail=64), _hf_loss, (8, 16)),                 # local/global, GLU, unpadding
        Arch("longformer", "encoder", _hf("LongformerForMaskedLM", "LongformerConfig", vocab_size=50265,
                                         hidden_size=768, num_hidden_layers=4, num_attention_heads=12,
                                         intermediate_size=3072, attention_window=[256] * 4,
                                         max_position_embeddings=4098),
             _tokens(50265, 1024), _hf_loss, (4, 8)),                                # sliding chunks
        Arch("big-bird", "encoder", _hf("BigBirdForMaskedLM", "BigBirdConfig", vocab_size=50358, hidden_size=768,
                                       num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072,
                                       attention_type="block_sparse", block_size=64, num_random_blocks=3,
                                       max_position_embeddings=4096),
             _tokens(50358, 1024), _hf_loss, (4, 8)),                                # block-sparse, random blocks
        # vision
        Arch("vit", "vision", _hf("ViTForImageClassification", "ViTConfig", hidden_size=768, num_hidden_layers=6,
                                 num_attention_heads=12, intermediate_size=3072, image_size=224, patch_size=16,
                                 num_labels=1000),
             _images(224, 1000), _hf_loss, (32, 64)),
        Arch("swin", "vision", _hf("SwinForImageClassification", "SwinConfig", image_size=224, embed_dim=96,
                                  depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24], window_size=7, num_labels=1000),
             _images(224, 1000), _hf_loss, (32, 64)),
        Arch("convnext", "vision", _hf("ConvNextForImageClassification", "ConvNextConfig", num_channels=3,
                                      hidden_sizes=[96, 192, 384, 768], depths=[2, 2, 6, 2], num_labels=1000),
             _images(224, 1000), _hf_loss, (32, 64)),
        Arch("beit", "vision", _hf("BeitForImageClassification", "BeitConfig", hidden_size=768, num_hidden_layers=4,
                                  num_attention_heads=12, intermediate_size=3072, image_size=224, patch_size=16,
                                  use_relative_position_bias=True, num_labels=1000),
             _images(224, 1000), _hf_loss, (32, 64)),
        Arch("segformer", "vision", _hf("SegformerForSemanticSegmentation", "SegformerConfig", num_labels=150,
                                       depths=[2, 2, 2, 2], hidden_sizes=[32, 64, 160, 256],
                                       decoder_hidden_size=256),
             _segmentation_inputs, _hf_loss, (8, 16)),
        Arch("dinov2", "vision", _hf("Dinov2ForImageClassification", "Dinov2Config", hidden_size=768,
                                    num_hidden_layers=6, num_attention_heads=12, image_size=224, patch_size=14,
                                    num_labels=1000),
             _images(224, 1000), _hf_loss, (32, 64)),                                # layer scale, 14px patches
        Arch("mobilevit", "vision", _hf("MobileViTForImageClassification", "MobileViTConfig", image_size=256,
                                       num_labels=1000),
             _images(256, 1000), _hf_loss, (32, 64)),                                # convolutions and unfolded patches
        Arch("clip", "contrastive", _hf("CLIPModel", "CLIPConfig",
                                       text_config={"vocab_size": 49408, "hidden_size": 512, "num_hidden_layers": 6,
                                                    "num_attention_heads": 8, "intermediate_size": 2048},
                                       vision_config={"hidden_size": 768, "num_hidden_layers": 6,
                                                      "num_attention_heads": 12, "intermediate_size": 3072,
                                                      "image_size": 224, "patch_size": 16}),
             _clip_inputs, _hf_loss, (32, 64)),                                      # two towers, batch x batch logits
        # speech
        Arch("wav2vec2", "speech", _hf("Wav2Vec2ForCTC", "Wav2Vec2Config", vocab_size=32, hidden_size=768,
                                      num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072,
                                      ctc_loss_reduction="mean", mask_time_prob=0.0),
             _ctc_inputs, _hf_loss, (4, 8)),
        Arch("hubert", "speech", _hf("HubertForSequenceClassification", "HubertConfig", hidden_size=768,
                                    num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072,
                                    num_labels=12, mask_time_prob=0.0),
             _audio_class_inputs, _hf_loss, (4, 8)),
    ]


def _clip_inputs(n: int) -> dict:
    """Captions of 77 tokens and their images; the loss contrasts every pair in the batch."""
    return {"input_ids": torch.randint(0, 49408, (n, 77)), "attention_mask": torch.ones(n, 77, dtype=torch.long),
            "pixel_values": torch.randn(n, 3, 224, 224), "return_loss": True}


def _whisper_inputs(n: int) -> dict:
    return {"input_features": torch.randn(n, 80, 3000), "labels": torch.randint(0, 51865, (n, 128))}


def _segmentation_inputs(n: int) -> dict:
    return {"pixel_values": torch.randn(n, 3, 512, 512), "labels": torch.randint(0, 150, (n, 512, 512))}


def _ctc_inputs(n: int) -> dict:
    """10 s of 16 kHz audio and a transcript padded with -100 (CTC drops the padding)."""
    labels = torch.randint(1, 32, (n, 160))
    labels[:, 120:] = -100
    return {"input_values": torch.randn(n, 160000), "attention_mask": torch.ones(n, 160000, dtype=torch.long),
            "labels": labels}


def _audio_class_inputs(n: int) -> dict:
    return {"input_values": torch.randn(n, 160000), "labels": torch.randint(0, 12, (n,))}


# ----------------------------------------------------------------------- plain torch
class RNNLM(nn.Module):
    """An LSTM or GRU language model (cuDNN's fused RNN on a GPU); its own checkpointing
    recomputes the recurrent stack in backward."""

    def __init__(self, cell: str, vocab: int = 32000, dim: int = 1024, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = getattr(nn, cell)(dim, dim, num_layers=layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)
        self.checkpointing = False

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.checkpointing = True

    def _recurrent(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.checkpointing and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(self._recurrent, x, use_reentrant=False)
        else:
            out = self._recurrent(x)
        return self.head(out)


def _rnn_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


class EncoderLM(nn.Module):
    """torch's own nn.TransformerEncoder (nn.MultiheadAttention) with a causal mask."""

    def __init__(self, vocab: int = 32000, dim: int = 768, heads: int = 12, layers: int = 6, seq: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        return self.head(self.encoder(self.embed(ids) + self.pos[:seq], mask=mask, is_causal=True))


class _UNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, attention: bool) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(32, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(32, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
        self.attn = nn.MultiheadAttention(cout, 8, batch_first=True) if attention else None
        self.attn_norm = nn.GroupNorm(32, cout) if attention else None

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + t[:, : self.conv1.out_channels, None, None]
        h = self.skip(x) + self.conv2(F.silu(self.norm2(h)))
        if self.attn is not None:
            b, c, hh, ww = h.shape
            s = self.attn_norm(h).flatten(2).transpose(1, 2)
            a, _ = self.attn(s, s, s, need_weights=False)
            h = h + a.transpose(1, 2).reshape(b, c, hh, ww)
        return h


class UNet(nn.Module):
    """A diffusion-style UNet: GroupNorm, SiLU, self-attention at low resolution, ConvTranspose
    upsampling, a timestep embedding; trained to predict the noise."""

    def __init__(self, channels=(128, 256, 512), attention=(False, True, True)) -> None:
        super().__init__()
        self.time = nn.Sequential(nn.Linear(128, 512), nn.SiLU(), nn.Linear(512, 512))
        self.stem = nn.Conv2d(4, channels[0], 3, padding=1)
        self.down = nn.ModuleList()
        self.pools = nn.ModuleList()
        cin = channels[0]
        for c, a in zip(channels, attention):
            self.down.append(_UNetBlock(cin, c, a))
            self.pools.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
            cin = c
        self.mid = _UNetBlock(cin, cin, True)
        self.ups = nn.ModuleList()
        self.up = nn.ModuleList()
        for c, a in zip(reversed(channels), reversed(attention)):
            self.ups.append(nn.ConvTranspose2d(cin, cin, 4, stride=2, padding=1))
            self.up.append(_UNetBlock(cin + c, c, a))
            cin = c
        self.out = nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU(), nn.Conv2d(cin, 4, 3, padding=1))

    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        half = 64
        freqs = torch.exp(-torch.arange(half, device=x.device, dtype=torch.float32) * (9.21 / half))
        emb = steps.float()[:, None] * freqs[None]
        t = self.time(torch.cat([emb.sin(), emb.cos()], dim=1))
        h = self.stem(x)
        skips = []
        for block, pool in zip(self.down, self.pools):
            h = block(h, t)
            skips.append(h)
            h = pool(h)
        h = self.mid(h, t)
        for up, block in zip(self.ups, self.up):
            h = up(h)
            h = block(torch.cat([h, skips.pop()], dim=1), t)
        return self.out(h)


def _unet_inputs(n: int) -> dict:
    return {"latents": torch.randn(n, 4, 64, 64), "noise": torch.randn(n, 4, 64, 64),
            "steps": torch.randint(0, 1000, (n,))}


def _unet_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    noisy = batch["latents"] + batch["noise"]
    return F.mse_loss(model(noisy, batch["steps"]), batch["noise"])


def _lm_inputs(vocab: int, seq: int) -> Callable[[int], dict]:
    def inputs(n: int) -> dict:
        ids = torch.randint(0, vocab, (n, seq))
        return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    return inputs


def _torch_zoo() -> list[Arch]:
    return [
        Arch("lstm", "rnn", lambda: RNNLM("LSTM"), _lm_inputs(32000, 256), _rnn_loss, (16, 32), "model", "torch"),
        Arch("gru", "rnn", lambda: RNNLM("GRU"), _lm_inputs(32000, 256), _rnn_loss, (16, 32), "model", "torch"),
        Arch("torch-transformer", "encoder", EncoderLM, _lm_inputs(32000, 1024), _rnn_loss, (4, 8),
             source="torch"),
        Arch("unet", "diffusion", UNet, _unet_inputs, _unet_loss, (8, 16), source="torch"),
    ]


# ----------------------------------------------------------------------- torchvision
def _tv(name: str, **kwargs) -> Callable[[], nn.Module]:
    """torchvision.models.<name> ("detection.<name>" for a submodule's), random weights."""
    def make() -> nn.Module:
        import importlib
        module, _, fn = f"torchvision.models.{name}".rpartition(".")
        return getattr(importlib.import_module(module), fn)(weights=None, **kwargs)
    return make


def _seg_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(batch["pixel_values"])
    return F.cross_entropy(out["out"], batch["labels"]) + 0.5 * F.cross_entropy(out["aux"], batch["labels"])


def _seg_inputs(n: int) -> dict:
    return {"pixel_values": torch.randn(n, 3, 384, 384), "labels": torch.randint(0, 21, (n, 384, 384))}


def _detection_inputs(n: int) -> dict:
    """Images with 4 boxes each, as torchvision's detection models take them."""
    boxes = torch.tensor([[10.0, 20.0, 200.0, 220.0], [50.0, 60.0, 120.0, 300.0], [300.0, 310.0, 500.0, 480.0],
                          [5.0, 400.0, 90.0, 500.0]])
    return {"images": [torch.rand(3, 512, 512) for _ in range(n)],
            "targets": [{"boxes": boxes.clone(), "labels": torch.tensor([1, 2, 3, 4])} for _ in range(n)]}


def _detection_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    losses = model(batch["images"], batch["targets"])
    return sum(losses.values())


def _torchvision_zoo() -> list[Arch]:
    try:
        import torchvision  # noqa: F401
    except Exception:       # not installed, or built for another torch: left out of the zoo
        return []
    return [
        Arch("tv-resnet50", "vision", _tv("resnet50"), _images(224, 1000), _classifier_loss, (64, 128),
             source="torchvision"),
        Arch("tv-mobilenet-v3", "vision", _tv("mobilenet_v3_large"), _images(224, 1000), _classifier_loss,
             (64, 128), source="torchvision"),
        Arch("tv-efficientnet-b0", "vision", _tv("efficientnet_b0"), _images(224, 1000), _classifier_loss,
             (32, 64), source="torchvision"),
        Arch("tv-deeplabv3", "segmentation", _tv("segmentation.deeplabv3_resnet50", weights_backbone=None, num_classes=21,
                                                 aux_loss=True),
             _seg_inputs, _seg_loss, (4, 8), source="torchvision"),
        Arch("tv-fasterrcnn", "detection", _tv("detection.fasterrcnn_mobilenet_v3_large_fpn", weights_backbone=None,
                                               num_classes=91),
             _detection_inputs, _detection_loss, (4, 8), source="torchvision"),
    ]


def _zoo() -> dict[str, Arch]:
    archs: list[Arch] = []
    try:
        import transformers  # noqa: F401
        archs += _transformers_zoo()
    except ImportError:
        pass
    archs += _torch_zoo() + _torchvision_zoo()
    from holdout_models import holdout          # imports this module's helpers, defined by now
    archs += [dataclasses.replace(a, held_out=True) for a in holdout()]
    return {a.name: a for a in archs}


ZOO: dict[str, Arch] = _zoo()


def names() -> list[str]:
    return list(ZOO)


def build(name: str, batch: int, own_checkpointing: bool = False, lr: float = 1e-4):
    """(model, optimizer, batch, loss_fn) of the architecture `name` at `batch` samples, on
    the default device; AdamW. `own_checkpointing`: turn on the model's own full activation
    checkpointing (gradient_checkpointing_enable, non-reentrant). The model is moved to the
    default device as a training script moves it: a legacy constructor (XLNet's
    `torch.FloatTensor(...)` parameters) makes its tensor on the CPU whatever the default."""
    arch = ZOO[name]
    model = arch.make().to(torch.get_default_device())
    model.train()
    if own_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if getattr(getattr(model, "config", None), "use_cache", None):
            model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, optimizer, arch.inputs(batch), arch.loss


def describe() -> list[dict[str, Any]]:
    """The zoo as rows (name, family, source, batches, checkpointing, held out)."""
    return [{"name": a.name, "family": a.family, "source": a.source, "batches": list(a.batches),
             "checkpointing": a.checkpointing, "held_out": a.held_out} for a in ZOO.values()]
