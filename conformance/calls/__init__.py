"""The call layer: one module per level that makes its calls and checks them, with call specs and reports."""
