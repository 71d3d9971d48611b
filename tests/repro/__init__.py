"""Regression tests of the findings of "No silent wrong answers", one test per finding (or per case of
finding 6), written against the public API. Each asserts the correct behaviour (a match with the
plain-PyTorch reference at every step, or a ParatrainError naming the user's module); its docstring
says what used to go wrong."""
