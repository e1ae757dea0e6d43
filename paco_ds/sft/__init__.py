"""PaCo-Reward SFT: Qwen2.5-VL LoRA training on pairwise consistency data (PaCo-RL/PaCo-Reward).

config.py  the recipe schema          data.py   records, chat template, labels, batches, synthetic pairs
loss.py    first_token_weight loss     model.py  model + LoRA + the fused LM-head loss under ZeRO-3
trainer.py the DeepSpeed loop          export.py adapter -> merged model directory, P(Yes) scoring
"""
