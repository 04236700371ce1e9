"""Operations on published tables: rollback, maintenance and the archiver's run."""
