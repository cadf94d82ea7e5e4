"""How answers are scored and corrected: the scoring rules (accuracy, NLL, Brier, ECE, coverage), the RLCD loss,
the read-out calibration's fit (temperature and bias per group) and the report's tables and plots."""
