"""Engine benchmarks: one engine setting or feature against another in the same run (the offline `LLM`, or
`llmserve serve` where the setting shows there)."""
