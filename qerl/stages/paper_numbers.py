"""The paper's reported numbers (QeRL, arXiv 2510.11696; ../shared/docs/paper.md), for the tables'
adjacent columns."""

#: Table 1: GSM8K accuracy after GRPO on GSM8K, by row label and model size.
TABLE1 = {
    "bf16, untrained": {"3B": 61.2, "7B": 76.3},
    "NVFP4, untrained": {"3B": 59.4, "7B": 73.4},
    "bf16 full fine-tuning": {"3B": 84.4, "7B": 91.2},
    "bf16 LoRA": {"3B": 76.1, "7B": 88.1},
    "NF4 LoRA (QLoRA)": {"3B": 76.1, "7B": 85.0},
    "NVFP4 LoRA": {"3B": 83.3, "7B": 88.5},
    "NVFP4 LoRA + AQN (QeRL)": {"3B": 83.7, "7B": 90.8},
}
#: The rows of the paper's Table 2 (qerl.methods names).
TABLE2_ROWS = ("bf16", "full", "lora", "nvfp4_lora", "qerl")
TABLE2_BENCHMARKS = ("math500", "aime24", "aime25", "amc23")
#: Table 2: DAPO on BigMath; (size, method) -> MATH500, AIME24, AIME25, AMC23, avg.
TABLE2 = {
    ("7B", "bf16"): (74.8, 9.2, 6.6, 25.0, 28.9), ("7B", "full"): (77.4, 16.7, 10.0, 45.0, 37.3),
    ("7B", "lora"): (77.0, 13.3, 10.0, 42.5, 35.7), ("7B", "nvfp4_lora"): (76.8, 13.7, 10.0, 47.5, 37.0),
    ("7B", "qerl"): (77.4, 15.5, 10.0, 42.5, 36.4),
    ("14B", "bf16"): (78.6, 11.3, 9.2, 45.0, 36.0), ("14B", "full"): (83.2, 20.0, 15.1, 55.0, 43.3),
    ("14B", "lora"): (81.0, 14.0, 13.3, 52.5, 40.2), ("14B", "qerl"): (80.2, 17.5, 12.6, 57.5, 42.0),
    ("32B", "bf16"): (81.4, 14.0, 10.8, 52.5, 39.7), ("32B", "full"): (84.0, 20.0, 23.3, 57.5, 46.2),
    ("32B", "lora"): (83.6, 16.7, 13.3, 55.0, 42.2), ("32B", "qerl"): (83.3, 16.7, 19.2, 63.3, 45.6),
}
