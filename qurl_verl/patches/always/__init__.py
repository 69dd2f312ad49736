"""Applied in every process that imports verl; each acts only on configs that use qurl-verl."""
