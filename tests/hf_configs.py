"""Users' Hugging Face ``config.json`` contents the CLI tests write to disk."""

# a small Llama of width 64, four layers deep (``--layers`` reduces it), vocabulary 512
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
              "num_hidden_layers": 4, "vocab_size": 512, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False}
