"""LoRA mixture of experts over capability adapters (paper section 3.5, Appendix D).

layer.py: LoRAMoELinear and routing; model.py: build/save/load a composed model from peft adapters;
gate.py: gate training (CE + load balancing); params.py: parameter accounting (Table 5).
"""
