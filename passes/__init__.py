"""Compiler passes, one file each (Program -> Program, one invariant, a ``check`` that proves it);
pipeline.py holds the list that runs them."""
