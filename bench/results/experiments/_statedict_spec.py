"""The bench state dict's names and shapes (bench/suites/statedict.cpp's Model, bf16), for the scripts here that
run on their own on a GPU machine: 32 layers make the 2 GiB dict of 291 tensors, 340 the 16 GiB one of 3063."""


def spec(layers):
    h, kv, mlp, vocab = 1536, 256, 4096, 95540
    s = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        s += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
              (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
              (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
              (p + "mlp.gate_proj.weight", (mlp, h)), (p + "mlp.up_proj.weight", (mlp, h)),
              (p + "mlp.down_proj.weight", (h, mlp))]
    return s + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
