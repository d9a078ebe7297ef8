"""A small PyTorch Llama for the trainer side of vroll: llama2.c checkpoint and tokenizer loading,
a batched forward that gives per-token logprobs, and export of weights under the Hugging Face
canonical names that vroll's weight updates use.

Same arithmetic as vroll's C++ model (policy/llama_model.h): RMSNorm, interleaved RoPE
(llama2.c), grouped-query attention, SwiGLU, tied output head. Formats: ../shared/models/SOURCES.md.
"""
import math
import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Config:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self):
        return self.dim // self.n_heads


# The embedded default of vroll (policy/default_model.cc DefaultModelConfig): byte-level vocab.
DEFAULT_CONFIG = Config(dim=64, hidden_dim=172, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=259, max_seq_len=256)


class Llama(torch.nn.Module):
    """Decoder-only Llama. Parameters are named by their Hugging Face canonical names, with dots
    replaced by '__' (torch forbids dots in parameter names); `hf_state_dict` restores them."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        d, h, kv, hd = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        p = torch.nn.ParameterDict()
        p["model__embed_tokens__weight"] = torch.nn.Parameter(torch.zeros(cfg.vocab_size, d))
        for i in range(cfg.n_layers):
            pre = f"model__layers__{i}__"
            p[pre + "input_layernorm__weight"] = torch.nn.Parameter(torch.ones(d))
            p[pre + "self_attn__q_proj__weight"] = torch.nn.Parameter(torch.zeros(h * hd, d))
            p[pre + "self_attn__k_proj__weight"] = torch.nn.Parameter(torch.zeros(kv * hd, d))
            p[pre + "self_attn__v_proj__weight"] = torch.nn.Parameter(torch.zeros(kv * hd, d))
            p[pre + "self_attn__o_proj__weight"] = torch.nn.Parameter(torch.zeros(d, h * hd))
            p[pre + "post_attention_layernorm__weight"] = torch.nn.Parameter(torch.ones(d))
            p[pre + "mlp__gate_proj__weight"] = torch.nn.Parameter(torch.zeros(cfg.hidden_dim, d))
            p[pre + "mlp__up_proj__weight"] = torch.nn.Parameter(torch.zeros(cfg.hidden_dim, d))
            p[pre + "mlp__down_proj__weight"] = torch.nn.Parameter(torch.zeros(d, cfg.hidden_dim))
        p["model__norm__weight"] = torch.nn.Parameter(torch.ones(d))
        self.p = p
        # RoPE as llama2.c computes it (float32): freq_j = theta^(-2j/head_dim), angle = pos * freq_j.
        j = torch.arange(0, hd, 2, dtype=torch.float32)
        freqs = 1.0 / (cfg.rope_theta ** (j / hd))
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), freqs)
        self.register_buffer("cos", torch.cos(angles), persistent=False)
        self.register_buffer("sin", torch.sin(angles), persistent=False)

    def init_random(self, seed: int, std: float = 0.02):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, t in self.p.items():
                if t.dim() == 1:
                    t.fill_(1.0)
                else:
                    t.copy_(torch.randn(t.shape, generator=g) * std)
        return self

    def hf_state_dict(self):
        """{canonical name: tensor} (detached views), the names vroll's weight updates use."""
        return {k.replace("__", "."): v.detach() for k, v in self.p.items()}

    @staticmethod
    def _rmsnorm(x, w, eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def _rope(self, x, T):
        # x: [B, T, H, D], interleaved pairs (2j, 2j+1).
        cos = self.cos[:T].view(1, T, 1, -1)
        sin = self.sin[:T].view(1, T, 1, -1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    def forward(self, tokens):
        """tokens [B, T] int64 -> logits [B, T, vocab] (causal; row t predicts token t+1)."""
        cfg, p = self.cfg, self.p
        B, T = tokens.shape
        h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = F.embedding(tokens, p["model__embed_tokens__weight"])
        for i in range(cfg.n_layers):
            pre = f"model__layers__{i}__"
            a = self._rmsnorm(x, p[pre + "input_layernorm__weight"], cfg.norm_eps)
            q = self._rope((a @ p[pre + "self_attn__q_proj__weight"].t()).view(B, T, h, hd), T)
            k = self._rope((a @ p[pre + "self_attn__k_proj__weight"].t()).view(B, T, kv, hd), T)
            v = (a @ p[pre + "self_attn__v_proj__weight"].t()).view(B, T, kv, hd)
            k = k.repeat_interleave(h // kv, dim=2)
            v = v.repeat_interleave(h // kv, dim=2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)
            att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
            x = x + att.transpose(1, 2).reshape(B, T, h * hd) @ p[pre + "self_attn__o_proj__weight"].t()
            m = self._rmsnorm(x, p[pre + "post_attention_layernorm__weight"], cfg.norm_eps)
            gate = m @ p[pre + "mlp__gate_proj__weight"].t()
            up = m @ p[pre + "mlp__up_proj__weight"].t()
            x = x + (F.silu(gate) * up) @ p[pre + "mlp__down_proj__weight"].t()
        x = self._rmsnorm(x, p["model__norm__weight"], cfg.norm_eps)
        return x @ p["model__embed_tokens__weight"].t()

    def token_logprobs(self, sequences, prompt_lens, temperature=1.0):
        """Per-token logprobs of each sequence's generated part.

        sequences: list of lists of ids (prompt + output); prompt_lens: list of int.
        Returns (logp [B, L] with zeros past each output, mask [B, L]) where L is the longest
        output; logp[b, i] = log_softmax(logits / temperature) of output token i of sequence b.
        """
        B = len(sequences)
        T = max(len(s) for s in sequences)
        L = max(len(s) - pl for s, pl in zip(sequences, prompt_lens))
        tokens = torch.zeros(B, T, dtype=torch.long)
        for b, s in enumerate(sequences):
            tokens[b, : len(s)] = torch.tensor(s)
        logits = self.forward(tokens[:, :-1]) / temperature
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        targets = tokens[:, 1:]
        picked = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T-1]
        out = torch.zeros(B, L)
        mask = torch.zeros(B, L)
        rows = []
        for b, (s, pl) in enumerate(zip(sequences, prompt_lens)):
            n = len(s) - pl
            rows.append(picked[b, pl - 1 : pl - 1 + n])
            mask[b, :n] = 1
        out = torch.stack([F.pad(r, (0, L - r.numel())) for r in rows])
        return out, mask


def load_llama2c(path):
    """llama2.c legacy checkpoint -> Llama (shared classifier only, as stories260K)."""
    with open(path, "rb") as f:
        data = f.read()
    dim, hidden, layers, heads, kv_heads, vocab, seq = struct.unpack("<7i", data[:28])
    if vocab <= 0:
        raise ValueError(f"{path}: header field vocab_size = {vocab}: unshared classifiers are not supported here")
    cfg = Config(dim, hidden, layers, heads, kv_heads, vocab, seq)
    w = torch.frombuffer(bytearray(data[28:]), dtype=torch.float32)
    model = Llama(cfg)
    hd, kv_dim = cfg.head_dim, cfg.head_dim * kv_heads
    off = 0

    def take(*shape):
        nonlocal off
        n = math.prod(shape)
        t = w[off : off + n].view(*shape)
        off += n
        return t

    with torch.no_grad():
        p = model.p
        p["model__embed_tokens__weight"].copy_(take(vocab, dim))
        per_layer = [
            ("input_layernorm__weight", (dim,)),
            ("self_attn__q_proj__weight", (dim, dim)),
            ("self_attn__k_proj__weight", (kv_dim, dim)),
            ("self_attn__v_proj__weight", (kv_dim, dim)),
            ("self_attn__o_proj__weight", (dim, dim)),
            ("post_attention_layernorm__weight", (dim,)),
            ("mlp__gate_proj__weight", (hidden, dim)),
            ("mlp__down_proj__weight", (dim, hidden)),
            ("mlp__up_proj__weight", (hidden, dim)),
        ]
        for name, shape in per_layer:  # each array is stacked over layers
            stacked = take(layers, *shape)
            for i in range(layers):
                p[f"model__layers__{i}__{name}"].copy_(stacked[i])
        p["model__norm__weight"].copy_(take(dim))
    return model


class Tokenizer:
    """llama2.c tokenizer.bin (run.c encode/decode), or byte-level (the embedded default)."""

    def __init__(self, pieces, scores):
        self.pieces = pieces
        self.scores = scores
        self.lookup = {p: i for i, p in enumerate(pieces)}

    @classmethod
    def load(cls, path, vocab_size):
        with open(path, "rb") as f:
            data = f.read()
        pos = 4
        pieces, scores = [], []
        for _ in range(vocab_size):
            score, n = struct.unpack_from("<fi", data, pos)
            pos += 8
            pieces.append(data[pos : pos + n])
            scores.append(score)
            pos += n
        return cls(pieces, scores)

    @classmethod
    def byte_level(cls):
        pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)]
        return cls(pieces, [0.0] * len(pieces))

    def encode(self, text, bos=True):
        ids = [1] if bos else []
        if text and b" " in self.lookup:
            ids.append(self.lookup[b" "])
        for ch in text:
            b = ch.encode("utf-8")
            if b in self.lookup:
                ids.append(self.lookup[b])
            else:
                ids.extend(x + 3 for x in b)
        while True:  # merge the best-scoring adjacent pair
            best, best_i, best_id = -1e10, -1, -1
            for i in range(len(ids) - 1):
                merged = self.pieces[ids[i]] + self.pieces[ids[i + 1]]
                j = self.lookup.get(merged)
                if j is not None and self.scores[j] > best:
                    best, best_i, best_id = self.scores[j], i, j
            if best_i < 0:
                return ids
            ids[best_i : best_i + 2] = [best_id]

    def decode(self, ids, prev=1):
        out = b""
        for t in ids:
            piece = self.pieces[t]
            if prev == 1 and piece.startswith(b" "):
                piece = piece[1:]
            if piece.startswith(b"<0x") and piece.endswith(b">") and len(piece) == 6:
                piece = bytes([int(piece[3:5], 16)])
            out += piece
            prev = t
        return out.decode("utf-8", errors="replace")
