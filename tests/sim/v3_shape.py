"""DeepSeek-V3's parameter and byte counts by hand, for the roofline's exact tests.

From its config.json: hidden 7168, 61 layers (the first 3 dense, 58 MoE), 128 heads,
q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128, intermediate 18432, 256
routed experts of 2048 + 1 shared, top-8, vocab 129280; FP8 weights with one float32 scale
per 128 x 128 block.
"""

V3_ATTN = (7168 * 1536 + 1536 + 1536 * 128 * 192                 # q_a, its norm, q_b
           + 7168 * 576 + 512 + 512 * 128 * 256                  # kv_a (latent + rope key), norm, kv_b
           + 128 * 128 * 7168)                                   # o
V3_EXPERT = 3 * 7168 * 2048                                      # 44,040,192
V3_PARAMS = (2 * 129280 * 7168 + 61 * (V3_ATTN + 2 * 7168) + 3 * 3 * 7168 * 18432
             + 58 * (257 * V3_EXPERT + 7168 * 256) + 7168)
V3_ACTIVE = V3_PARAMS - 129280 * 7168 - 58 * 248 * V3_EXPERT
V3_BPP = 1 + 4 / (128 * 128)                                     # FP8 + float32 block scales
V3_EXPERT_BYTES = V3_EXPERT * V3_BPP                             # 44,050,944
V3_DENSE_BYTES = (V3_PARAMS - 58 * 256 * V3_EXPERT) * V3_BPP
V3_ATTN_BYTES = 61 * (V3_ATTN + 2 * 7168) * V3_BPP               # replicated on every attention rank
V3_OTHER_BYTES = V3_DENSE_BYTES - V3_ATTN_BYTES
V3_KV_PER_TOKEN = 61 * (512 + 64) * 2                            # BF16 latent + RoPE key
