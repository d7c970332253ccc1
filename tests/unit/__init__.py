"""Single-process tests, one folder per package of src/dsl_lit, data_pipeline and data_contract (`make test-fast`)."""
