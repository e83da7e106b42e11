"""Column order of the kernel's descriptor rows (int64); shared by plan.py and _kernel.cu.

What it is: names only; ``plan.py``'s docstring says what each column holds.
"""

D_OFF, D_LEN, D_OUT, D_N, D_SYM, D_INFO, D_PREC, D_MODE, D_CMAP, D_STEP = range(10)
D_GRID, D_RMAP, D_KMAP, D_WIDTH, D_COL = range(10, 15)
N_COLS = 15
