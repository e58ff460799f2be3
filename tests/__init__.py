# A regular package, so `tests.*` imports resolve here even where a site-packages `tests` exists (swesmith ships one).
