"""What the recipes in ``recipes/`` run, apart from the product: the tiny offline model and its SFT,
arithmetic and math data with their rewards, evaluation, the small-scale report and the dry-run
checks. Importable in the development environment (the editable install puts the repository on
the path); not part of the ``qurl-verl`` wheel. Imports ``qurl_verl``, never the other way round.
"""
