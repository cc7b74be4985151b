"""Llama decoder in plain PyTorch, laid out exactly as GGUF's "llama" architecture expects.

RoPE rotates ADJACENT pairs (x[2i], x[2i+1]) by pos * theta^(-2i/head_dim), the llama.cpp
"normal" convention, so the q/k weights are exported without any permutation. Query head h
reads KV head h // (n_head // n_kv_head), as in llama.cpp.
"""
import dataclasses
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class Config:
    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 704
    context_length: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_output: bool = False

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), indent=2)

    @staticmethod
    def from_dict(d):
        return Config(**d)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(cfg, length, device=None):
    """cos/sin tables [length, head_dim // 2] for the adjacent-pair convention."""
    d = cfg.head_dim
    inv_freq = cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    pos = torch.arange(length, dtype=torch.float64, device=device)
    ang = torch.outer(pos, inv_freq)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin):
    # x: [B, H, T, D]; cos/sin: [T, D/2]
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    return torch.stack((y0, y1), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        cfg = self.cfg
        B, T, _ = x.shape
        hd = cfg.head_dim
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, cfg.n_heads, hd).transpose(1, 2)
        k = self.wk(h).view(B, T, cfg.n_kv_heads, hd).transpose(1, 2)
        v = self.wv(h).view(B, T, cfg.n_kv_heads, hd).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        group = cfg.n_heads // cfg.n_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        if x.is_cuda:
            # Training on a GPU: the fused (flash) kernel, in the autocast dtype. RoPE's fp32
            # tables promoted q and k to fp32; v is already in the autocast dtype.
            o = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            o = att @ v
        o = o.transpose(1, 2).reshape(B, T, cfg.n_heads * hd)
        x = x + self.wo(o)
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tied_output else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg, cfg.context_length)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)
        for b in self.blocks:  # GPT-2 style scaled init of residual projections
            nn.init.normal_(b.wo.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))
            nn.init.normal_(b.w_down.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        """idx: [B, T] token ids -> logits [B, T, vocab]."""
        T = idx.shape[1]
        assert T <= self.cfg.context_length
        mask = torch.ones(T, T, dtype=torch.bool, device=idx.device).triu(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        for b in self.blocks:
            x = b(x, cos, sin, mask)
        x = self.norm(x)
        if self.output is None:
            return x @ self.tok_emb.weight.t()
        return self.output(x)


def load_checkpoint(path):
    ck = torch.load(path, map_location="cpu", weights_only=False)
    cfg = Config.from_dict(ck["config"])
    model = Llama(cfg)
    model.load_state_dict(ck["model"])
    model.eval()
    return model, cfg, ck
