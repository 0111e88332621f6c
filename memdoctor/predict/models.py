"""Well-known models as data: small self-contained definitions (no transformers, no
torchvision, no downloads), each with a builder, a batch maker and a loss.

    spec = MODELS["gpt2-124m"]
    build = spec.builder(batch=8, seq=1024, optimizer="adamw")
    model, optimizer, batch, loss_fn = build()          # real tensors on the default device
    memdoctor.predict.estimate.estimate_built(build, device="cuda")   # or fake ones, for an estimate

The shapes follow the published configurations (GPT-2 small/medium/large/XL, BERT
base/large with an MLM head, a Llama-3.2-1B-shaped decoder, ResNet-50, ViT-B/16);
attention is torch's scaled_dot_product_attention, as current transformers and
torchvision use. Dropout defaults to 0 (as nanoGPT's and Llama's pre-training): with
dropout > 0 each dropout site saves a 1-byte mask per element, which the estimate then
counts too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------- GPT-2


class GPT2Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d)))


class GPT2MLP(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = GPT2Attention(dim, heads, dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = GPT2MLP(dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT2LMHeadModel's shapes: learned positions, pre-LN blocks, tied LM head."""

    def __init__(self, layers: int, dim: int, heads: int, vocab: int = 50257, positions: int = 1024,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(positions, dim)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPT2Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----------------------------------------------------------------------- BERT


class BertLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.attn_out = nn.Linear(dim, dim)
        self.attn_norm = nn.LayerNorm(dim, eps=1e-12)
        self.intermediate = nn.Linear(dim, ffn)
        self.output = nn.Linear(ffn, dim)
        self.out_norm = nn.LayerNorm(dim, eps=1e-12)
        self.drop = nn.Dropout(dropout)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def heads(t):
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                                           dropout_p=self.dropout if self.training else 0.0)
        x = self.attn_norm(x + self.drop(self.attn_out(a.transpose(1, 2).reshape(b, s, d))))
        return self.out_norm(x + self.drop(self.output(F.gelu(self.intermediate(x)))))


class Bert(nn.Module):
    """BertForMaskedLM's shapes: post-LN encoder, MLM head tied to the word embeddings."""

    def __init__(self, layers: int, dim: int, heads: int, ffn: int, vocab: int = 30522,
                 positions: int = 512, dropout: float = 0.0) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, dim)
        self.position_embeddings = nn.Embedding(positions, dim)
        self.token_type_embeddings = nn.Embedding(2, dim)
        self.emb_norm = nn.LayerNorm(dim, eps=1e-12)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(BertLayer(dim, heads, ffn, dropout) for _ in range(layers))
        self.transform = nn.Linear(dim, dim)
        self.transform_norm = nn.LayerNorm(dim, eps=1e-12)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.word_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        types = torch.zeros_like(ids)
        x = self.word_embeddings(ids) + self.position_embeddings(pos) + self.token_type_embeddings(types)
        x = self.drop(self.emb_norm(x))
        for layer in self.layers:
            x = layer(x)
        return self.decoder(self.transform_norm(F.gelu(self.transform(x))))


# ----------------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    """LlamaRMSNorm: computed in fp32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:s].to(q.dtype), sin[:s].to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if rep > 1:     # transformers' repeat_kv
            k = k[:, :, None].expand(b, self.kv_heads, rep, s, self.head_dim).reshape(b, self.heads, s, self.head_dim)
            v = v[:, :, None].expand(b, self.kv_heads, rep, s, self.head_dim).reshape(b, self.heads, s, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = LlamaAttention(dim, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = LlamaMLP(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """LlamaForCausalLM's shapes: RMSNorm, rotary positions, grouped-query attention, SwiGLU."""

    def __init__(self, layers: int, dim: int, heads: int, kv_heads: int, hidden: int, vocab: int,
                 positions: int = 2048, theta: float = 500000.0, tie: bool = True) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight
        head_dim = dim // heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


# ----------------------------------------------------------------------- ResNet-50


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's resnet50 (v1.5: stride in the 3x3 conv)."""

    def __init__(self, layers=(3, 4, 6, 3), classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._layer(64, layers[0])
        self.layer2 = self._layer(128, layers[1], stride=2)
        self.layer3 = self._layer(256, layers[2], stride=2)
        self.layer4 = self._layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * 4, classes)

    def _layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ----------------------------------------------------------------------- ViT-B/16


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class ViT(nn.Module):
    """torchvision's vit_b_16 shapes: 16x16 patches, class token, learned positions."""

    def __init__(self, image_size: int = 224, patch: int = 16, layers: int = 12, dim: int = 768,
                 heads: int = 12, mlp: int = 3072, classes: int = 1000) -> None:
        super().__init__()
        self.patch = patch
        self.conv_proj = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (image_size // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, dim).normal_(std=0.02))
        self.layers = nn.ModuleList(ViTBlock(dim, heads, mlp) for _ in range(layers))
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x)[:, 0])


# ----------------------------------------------------------------------- losses, batches


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """Next-token (or masked-token) cross entropy over every position; batch = (ids, labels)."""
    ids, labels = batch
    logits = model(ids)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def image_loss(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor")


def make_optimizer(name: str, model: nn.Module, lr: float = 1e-4) -> torch.optim.Optimizer:
    """An optimizer by name, with torch's defaults (foreach chosen by torch)."""
    name = name.lower()
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "adafactor" and hasattr(torch.optim, "Adafactor"):
        return torch.optim.Adafactor(model.parameters(), lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")


@dataclass
class ModelSpec:
    name: str
    kind: str                            # "lm" (ids, labels) or "image" (images, labels)
    make: Callable[..., nn.Module]
    description: str
    vocab: int | None = None
    max_seq: int | None = None           # None: any length (rotary positions)
    default_seq: int = 1024
    image_size: int = 224
    classes: int = 1000
    extra: dict = field(default_factory=dict)

    def build_model(self, seq: int | None = None, dropout: float = 0.0) -> nn.Module:
        if self.name.startswith("llama"):
            return self.make(positions=max(seq or self.default_seq, 2048))
        if self.kind == "image":
            return self.make()
        return self.make(dropout=dropout)

    def make_batch(self, batch: int, seq: int | None = None, image_size: int | None = None):
        """A batch on the default device: (ids, labels) or (images, labels)."""
        if self.kind == "lm":
            seq = seq or self.default_seq
            if self.max_seq is not None and seq > self.max_seq:
                raise ValueError(f"{self.name} has {self.max_seq} positions; --seq {seq} is longer")
            ids = torch.randint(0, self.vocab, (batch, seq))
            labels = torch.randint(0, self.vocab, (batch, seq))
            return ids, labels
        size = image_size or self.image_size
        return torch.randn(batch, 3, size, size), torch.randint(0, self.classes, (batch,))

    @property
    def loss_fn(self):
        return lm_loss if self.kind == "lm" else image_loss

    def builder(self, batch: int, seq: int | None = None, optimizer: str = "adamw", lr: float = 1e-4,
                dropout: float = 0.0, image_size: int | None = None) -> Callable[[], tuple]:
        """A no-argument function returning (model, optimizer, batch, loss_fn) on the default
        device: what memdoctor.predict.estimate.estimate_built and the GPU validation both call."""
        if self.kind == "image" and image_size not in (None, self.image_size) and self.name.startswith("vit"):
            raise ValueError(f"{self.name} is built for {self.image_size}px images")

        def build():
            model = self.build_model(seq, dropout)
            opt = make_optimizer(optimizer, model, lr)
            return model, opt, self.make_batch(batch, seq, image_size), self.loss_fn
        build.__name__ = f"build_{self.name.replace('-', '_')}"
        return build


def _gpt2(layers, dim, heads):
    return lambda dropout=0.0: GPT2(layers, dim, heads, dropout=dropout)


def _bert(layers, dim, heads, ffn):
    return lambda dropout=0.0: Bert(layers, dim, heads, ffn, dropout=dropout)


MODELS: dict[str, ModelSpec] = {
    "gpt2-124m": ModelSpec("gpt2-124m", "lm", _gpt2(12, 768, 12), "GPT-2 small: 12 layers, 768 wide, 12 heads",
                           vocab=50257, max_seq=1024),
    "gpt2-355m": ModelSpec("gpt2-355m", "lm", _gpt2(24, 1024, 16), "GPT-2 medium: 24 layers, 1024 wide, 16 heads",
                           vocab=50257, max_seq=1024),
    "gpt2-774m": ModelSpec("gpt2-774m", "lm", _gpt2(36, 1280, 20), "GPT-2 large: 36 layers, 1280 wide, 20 heads",
                           vocab=50257, max_seq=1024),
    "gpt2-1.5b": ModelSpec("gpt2-1.5b", "lm", _gpt2(48, 1600, 25), "GPT-2 XL: 48 layers, 1600 wide, 25 heads",
                           vocab=50257, max_seq=1024),
    "bert-base": ModelSpec("bert-base", "lm", _bert(12, 768, 12, 3072),
                           "BERT-base with an MLM head: 12 layers, 768 wide", vocab=30522, max_seq=512,
                           default_seq=512),
    "bert-large": ModelSpec("bert-large", "lm", _bert(24, 1024, 16, 4096),
                            "BERT-large with an MLM head: 24 layers, 1024 wide", vocab=30522, max_seq=512,
                            default_seq=512),
    "llama-1b": ModelSpec("llama-1b", "lm",
                          lambda positions=2048: Llama(16, 2048, 32, 8, 8192, 128256, positions=positions),
                          "Llama-3.2-1B shapes: 16 layers, 2048 wide, 32 heads / 8 KV heads, SwiGLU 8192, "
                          "128256 vocab, tied", vocab=128256, max_seq=None, default_seq=2048),
    "resnet50": ModelSpec("resnet50", "image", ResNet, "ResNet-50 (torchvision v1.5), 224px"),
    "vit-b16": ModelSpec("vit-b16", "image", ViT, "ViT-B/16, 224px"),
}
ALIASES = {"gpt2": "gpt2-124m", "gpt2-small": "gpt2-124m", "gpt2-medium": "gpt2-355m",
           "gpt2-large": "gpt2-774m", "gpt2-xl": "gpt2-1.5b", "bert": "bert-base", "llama": "llama-1b",
           "resnet-50": "resnet50", "vit": "vit-b16", "vit-b/16": "vit-b16"}


def get(name: str) -> ModelSpec:
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[key]


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

