"""One module a chapter: each function returns one section's values and the claims its sentences make.

The sentences themselves live in the chapter's template, ``notebooks/prose/<chapter>.md``; a module here
supplies numbers, lists and tables, never English. Chapters not yet moved here are still built by
:mod:`kvlab.facts`, whose values these modules read.
"""
