"""A minimal HF-compatible Llama in torch (target teacher and draft student) and the draft's initialisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draft_training.common import EMBED_KEY, draft_config


class RMSNorm(torch.nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class _Attn(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c.get("head_dim", 64)
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = torch.nn.Linear(H, nh * hd, bias=False)
        self.k_proj = torch.nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = torch.nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = torch.nn.Linear(nh * hd, H, bias=False)


class _MLP(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        H, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = torch.nn.Linear(H, I, bias=False)
        self.up_proj = torch.nn.Linear(H, I, bias=False)
        self.down_proj = torch.nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = _Attn(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class _Inner(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList(_Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


def _rot_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


class Llama(torch.nn.Module):
    """Same math and parameter names as HF LlamaForCausalLM (tied embeddings, default rope)."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.model = _Inner(c)
        hd = c.get("head_dim", 64)
        self.register_buffer("inv_freq", 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)),
                             persistent=False)

    def hidden(self, ids, pos=None, cache=None, start: int = 0, key_mask=None):
        """ids/pos [B,T].  cache: list of (K, V) [B,nkv,Lmax,hd] written at slots start..start+T-1 (then
        key_mask [B, start+T] marks valid key slots).  Without cache: plain causal attention."""
        B, T = ids.shape
        if pos is None:
            pos = torch.arange(T, device=ids.device).expand(B, T)
        f = pos[..., None].float() * self.inv_freq
        emb = torch.cat((f, f), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        x = self.model.embed_tokens(ids)
        mask = None
        if cache is not None:
            S = start + T
            qs = torch.arange(start, S, device=ids.device)
            ks = torch.arange(S, device=ids.device)
            mask = (ks[None, :] <= qs[:, None])[None] & key_mask[:, None, :S].bool()
            mask = (mask | (ks[None, :] == qs[:, None])[None])[:, None]  # a pad query sees itself: no NaN
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(B, T, a.nh, a.hd).transpose(1, 2)
            k = a.k_proj(h).view(B, T, a.nkv, a.hd).transpose(1, 2)
            v = a.v_proj(h).view(B, T, a.nkv, a.hd).transpose(1, 2)
            q = q * cos + _rot_half(q) * sin
            k = k * cos + _rot_half(k) * sin
            if cache is not None:
                K, V = cache[i]
                K[:, :, start:start + T] = k
                V[:, :, start:start + T] = v
                k, v = K[:, :, :start + T], V[:, :, :start + T]
            rep = a.nh // a.nkv
            k = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, a.nh, -1, a.hd)
            v = v[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, a.nh, -1, a.hd)
            if mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + a.o_proj(o.transpose(1, 2).reshape(B, T, a.nh * a.hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def logits(self, h):
        return h @ self.model.embed_tokens.weight.T

    def new_cache(self, B: int, L: int, device, dtype=torch.float32):
        c = self.c
        shape = (B, c["num_key_value_heads"], L, c.get("head_dim", 64))
        return [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                for _ in range(c["num_hidden_layers"])]


def make_draft(tcfg: dict, tsd: dict, layers: list, device) -> Llama:
    d = Llama(draft_config(tcfg, len(layers)))
    sd = {EMBED_KEY: tsd[EMBED_KEY], "model.norm.weight": tsd["model.norm.weight"]}
    for i, src in enumerate(layers):
        for k, v in tsd.items():
            if k.startswith(f"model.layers.{src}."):
                sd[k.replace(f"model.layers.{src}.", f"model.layers.{i}.")] = v
    d.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True)
    d.model.embed_tokens.weight.requires_grad_(False)
    return d.to(device)
