"""Environments the episode tests load as `environment` plug-ins (by file path, as a user's config would)."""

from jaxrl.environments.base import Environment

ALPHABETS = {"digits": set("0123456789"), "letters": set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")}


class Alphabet(Environment):
    """The first answer cannot be right: the alphabet the answer must use (digits or letters, drawn from the
    episode's seed) is told only in the first observation; the reward is the fraction of the second answer's
    characters in it (a first answer scores 0). A policy that does not read the observation scores at most 0.5 in
    expectation."""

    def reset(self, problem):
        self.wanted = "digits" if self.seed % 2 else "letters"
        return list(problem.messages)

    def step(self, turn):
        if turn.index == 0:  # an answer before the alphabet was told scores 0 (a turn cut at its cap is the last)
            return [{"role": "user", "content": f"Answer in {self.wanted}."}], 0.0, turn.last
        chars = [c for c in turn.text if not c.isspace()]
        score = sum(c in ALPHABETS[self.wanted] for c in chars) / len(chars) if chars else 0.0
        return [], score, True


class SolvedAt(Environment):
    """Solved at turn 1 + seed % 3 whatever the answer (reward 1, done); until then "Again." (0): a known
    solved-within-t for evaluation's recount, independent of the model (a turn cut at its cap ends the episode
    unsolved)."""

    def reset(self, problem):
        return list(problem.messages)

    def step(self, turn):
        if turn.index == self.seed % 3:
            return [], 1.0, True
        return [{"role": "user", "content": "Again."}], 0.0, False


class RaisesOnOddSeeds(Environment):
    """An environment that fails: its step raises for odd episode seeds (evaluation scores such an episode 0 and
    counts it failed, with a warning); even seeds end at once, unsolved."""

    def reset(self, problem):
        return list(problem.messages)

    def step(self, turn):
        if self.seed % 2:
            raise RuntimeError("the environment broke")
        return [], 0.0, True
