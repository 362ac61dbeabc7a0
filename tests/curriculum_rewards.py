"""A reward for tests/test_curriculum.py: problems named easy-* always pass, hard-* never, learn-* score a
completion by its characters, 0 to 0.5 (samples of one prompt differ, so its group has a signal)."""


def tiered(completion, problem, **kwargs):
    if problem.id.startswith("easy"):
        return 1.0
    if problem.id.startswith("hard"):
        return 0.0
    return (sum(ord(c) for c in completion) % 7) / 12.0  # at most 0.5: a group's mean is never "solved"
