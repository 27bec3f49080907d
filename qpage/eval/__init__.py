"""Quality measurement: teacher-forced perplexity and KL divergence over token windows."""
