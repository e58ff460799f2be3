"""The tau^2 family of library environments: real airline/retail tools and data models over small generated
databases (``common``), one environment per capability the paper names for tau^2."""
