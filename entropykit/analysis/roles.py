"""Tensor roles: what part of a model a tensor belongs to, guessed from its name.

What it is: ``role_of(name)`` -> one of ROLES, by ordered name patterns that cover the
usual checkpoint spellings (Llama/Qwen/Mistral, GPT-2, BERT, gpt-oss, compressed-tensors,
GPTQ/AWQ), and the rows of a KV cache ("layer.3.keys" -> "kv-keys", "layer.3.values" ->
"kv-values", their fp8 scales "layer.3.keys.scale" -> "scales"). The first matching rule
wins, so a scale inside an attention block is a "scales" tensor and BERT's
``attention.output.LayerNorm`` is a norm. What it is not: a model parser; an unknown
spelling is "other", never an error.
"""

from __future__ import annotations

import re

ROLES = ("attention", "mlp", "embeddings", "norms", "scales", "kv-keys", "kv-values", "other")

_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (role, re.compile(pattern, re.IGNORECASE))
    for role, pattern in (
        # Quantization side data: scales, zero points, global scales, MX block exponents.
        ("scales", r"(^|[._])(scales?|weight_scale\w*|input_scale|qzeros|zeros?|"
                   r"g_idx|\w*_scales)$"),
        # A KV cache's tensors (analysis._source names them); no weight name ends so.
        ("kv-keys", r"(^|\.)keys$"),
        ("kv-values", r"(^|\.)values$"),
        ("norms", r"norm|(^|[._])ln_?\w*[._]|layer_?norm"),
        ("embeddings", r"embed|(^|[._])(wte|wpe|lm_head|tok_embeddings)([._]|$)|^output\."),
        ("attention", r"attn|attention|(^|[._])([qkvo]_proj|qkv\w*|query|key|value|"
                      r"c_attn|wq|wk|wv|wo)([._]|$)"),
        ("mlp", r"mlp|ffn|feed_?forward|experts?|intermediate|(^|[._])(gate_proj|up_proj|"
                r"down_proj|gate_up_proj|fc\d|c_fc|w[123]|dense_h_to_4h|dense_4h_to_h|"
                r"output\.dense)([._]|$)"),
    )
)


def role_of(name: str) -> str:
    """The role of the tensor called ``name`` (one of ROLES)."""
    for role, pattern in _RULES:
        if pattern.search(name):
            return role
    return "other"
