"""Learning from a teacher: `onepass distill` (a teacher model's answers on unlabelled states) and rows whose targets
carry another engine's answers."""
