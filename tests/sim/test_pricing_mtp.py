"""The multi-token-prediction layers in the weights that must fit, against hand computations.

DeepSeek-V3 and V4 ship `num_nextn_predict_layers` MTP layers (DeepSeek-V3 technical report,
arXiv 2412.19437, sec. 2.2: a transformer block, a projection of [hidden; embedding] and norms,
the embedding and output head shared with the main model); every serving recipe loads them for
its draft, so they take memory the KV would otherwise have.  Model numbers are written out from
the shipped config.json; hardware numbers are read from the profiles.
"""

import pytest

from pddgw.sim import profiles
from pddgw.sim.roofline import Parallel, max_kv_tokens, memory_fit

PRO = profiles.model("deepseek-v4-pro")
V3 = profiles.model("deepseek-v3")
H100, H200 = profiles.hardware("H100-SXM"), profiles.hardware("H200-SXM")

# DeepSeek-V4-Pro's MTP layer (config.json: hidden 7168, q_lora 1536, 128 heads of 512, o_lora
# 1024 in 16 groups, 384 routed experts of 3 x 7168 x 3072 at MXFP4 + 1 shared, FP8 with one
# UE8M0 scale per 128 x 128 block); compress ratio 0: window-only, no indexer.
PRO_BPP = 1 + 1 / (128 * 128)
PRO_MTP_ATTN = (7168 * 1536 + 1536 + 1536 * 128 * 512          # q
                + 7168 * 512 + 512                              # kv
                + 128 * 512 * 1024 + 16 * 1024 * 7168           # grouped output
                + 2 * 7168)                                     # the block's two norms
PRO_MTP_REST = (2 * 7168 * 7168 + 3 * 7168                      # eh_proj; enorm, hnorm, final norm
                + 3 * 7168 * 3072 + 7168 * 384)                 # shared expert, router
PRO_MTP_ROUTED = 384 * 3 * 7168 * 3072 * (0.5 + 1 / 32)          # MXFP4
PRO_MTP = (PRO_MTP_ATTN + PRO_MTP_REST) * PRO_BPP + PRO_MTP_ROUTED
# DeepSeek-V3's (MLA, 256 experts of 3 x 7168 x 2048 at FP8 with float32 block scales).
V3_BPP = 1 + 4 / (128 * 128)
V3_MTP = ((7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
           + 2 * 7168 + 2 * 7168 * 7168 + 3 * 7168 + 3 * 7168 * 2048 + 7168 * 256) * V3_BPP
          + 256 * 3 * 7168 * 2048 * V3_BPP)


def test_mtp_layer_bytes():
    assert PRO.num_mtp_layers == 1 and V3.num_mtp_layers == 1
    assert PRO.mtp_weight_bytes == pytest.approx(PRO_MTP, rel=1e-12)
    assert PRO.mtp_attention_weight_bytes == pytest.approx(PRO_MTP_ATTN * PRO_BPP, rel=1e-12)
    assert 13.9e9 < PRO_MTP < 14.0e9                       # ~14 GB, 13.5 of it the FP4 experts
    assert V3.mtp_weight_bytes == pytest.approx(V3_MTP, rel=1e-12)
    assert 11.6e9 < V3_MTP < 11.7e9                        # the checkpoint's 14B adds embedding and head copies
    assert profiles.model("kimi-k2").mtp_weight_bytes == 0.0
    assert profiles.model("llama3-70b").mtp_weight_bytes == 0.0


def test_v4_pro_fit_holds_the_mtp_layer():
    # 8 x H200, DP8: each GPU holds all attention (the main layers' and the MTP layer's) and an
    # eighth of the rest; 32 sequences a rank keep their windows, the rest is KV at 5,511.4375 B.
    par = Parallel(tp=1, dp=8)
    attn = PRO.attention_weight_bytes
    main_rest = PRO.dense_weight_bytes - attn + 61 * 384 * PRO.expert_bytes
    weights = attn + PRO_MTP_ATTN * PRO_BPP + (main_rest + PRO_MTP - PRO_MTP_ATTN * PRO_BPP) / 8
    fit = memory_fit(PRO, H200, par, 0.9, max_seqs=256)
    assert fit.weights_gb == pytest.approx(weights / 1e9, rel=1e-12)
    assert fit.kv_tokens == int((141e9 * 0.9 - weights - 32 * 61 * 128 * 584) // 5511.4375) * 8
    # The MTP layer costs each GPU 0.30 GB of attention and 1.71 GB of the rest: ~2.0 GB of KV.
    without = attn + main_rest / 8
    assert weights - without == pytest.approx(0.2999e9 + 13.648e9 / 8, rel=1e-3)


def test_the_mtp_layer_shrinks_the_pool_and_a_refusal_names_it():
    # DP16 on H100: 18.7 GB of attention per GPU + 1/16 of the rest left 1.56 GB for KV; the MTP
    # layer's 0.30 + 13.65 / 16 GB leaves 0.40 GB.  One 8-GPU node held none before and holds
    # none now; the refusal names the MTP layer's share.
    fit = memory_fit(PRO, H100, Parallel(tp=1, dp=16))
    assert fit.kv_gb == pytest.approx(0.404, abs=1e-3)
    attn = PRO.attention_weight_bytes
    main_rest = PRO.dense_weight_bytes - attn + 61 * 384 * PRO.expert_bytes
    weights = attn + PRO_MTP_ATTN * PRO_BPP + (main_rest + PRO_MTP - PRO_MTP_ATTN * PRO_BPP) / 16
    assert fit.kv_gb == pytest.approx((72e9 - weights) / 1e9, rel=1e-12)
    with pytest.raises(ValueError, match=r"deepseek-v4-pro weights \(846\.8 GB \+ 13\.9 GB of MTP layers, "):
        max_kv_tokens(PRO, H100, Parallel(tp=1, dp=8))
