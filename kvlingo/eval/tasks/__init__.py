"""IFEval, ARC-Challenge and GSM8K: pinned data, prompts, answer parsers, the answering paths and the IFEval grader."""
