"""What a run reads: the pair and its config (`models`), prepared chats (`data`), the profiles' budgets
(`profiles`) and the types its flags parse into (`argtypes`). It imports the core and the records, nothing above."""
