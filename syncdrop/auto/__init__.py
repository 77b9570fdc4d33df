"""``syncdrop auto``: from a model and a cluster link to a chosen sync plan, a distilled model and a
report (:mod:`syncdrop.auto.pipeline`, :mod:`syncdrop.auto.report`)."""
