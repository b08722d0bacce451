"""The multi-process Dynamic-CP trainer: process groups, routing of clips, the step, its statistics."""
