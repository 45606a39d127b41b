import { describe, expect, it } from "vitest";
import { ranLate } from "../../src/redis/gate-reply.js";

type Steps = Parameters<typeof ranLate>[0];

/** Steps of the given scripts, each recording the reply its late handler is told. */
function steps(scripts: readonly string[], told: unknown[][]): Steps[number] {
  return scripts.map((script, i) => ({
    script: script as Steps[number][number]["script"],
    keys: [`k${i}`],
    args: ["", `a${i}`],
    resolve: () => {},
    reject: () => {},
    late: (keys: readonly string[], args: readonly (string | number)[], reply: unknown) => {
      told.push([script, keys[0], args[1], reply]);
    },
  }));
}

/**
 * A `gate` call run after its callers failed closed tells each step its own reply, read from the
 * call's reply as the call itself would have read it: calls admitted in one pass answer 1, with
 * their steps' figures flat after the last call's reply; any other call answers a list whose
 * fifth element is its steps' replies.
 */
describe("a gate call run late tells each step its own reply", () => {
  it("reads calls admitted in one pass from the flat figures, and the others from their own replies", () => {
    const told: unknown[][] = [];
    const stepsOf = [
      steps(["semaphore-acquire", "interval-gate-take", "token-bucket-take"], told),
      steps(["semaphore-acquire", "interval-gate-take"], told),
      steps(["semaphore-acquire", "interval-gate-take"], told),
      steps(["interval-gate-take"], told),
    ];
    // Calls 1 and 4 in one pass: a permit's fence, used, limit and epoch, a host's slots, then
    // the time they decided at. Call 2 admitted by the whole script; call 3 refused, rolled back.
    const replies = [
      1,
      [
        1,
        -1,
        0,
        0,
        [
          [1, 8, 2, 10, 0, 0, 0, 99],
          [1, "150", "160"],
        ],
      ],
      [0, 5, 0, 0, [[-2, 0, 2, 10, 0, 0, 0, 99], false]],
      1,
      [7, 1, 10, 0, "", "140", "150", "160", 99],
    ];
    ranLate(stepsOf, replies);
    expect(told).toEqual([
      ["semaphore-acquire", "k0", "a0", [1, 7, 1, 10, 0, 0, 0, 99]],
      ["interval-gate-take", "k1", "a1", [1, "", "140"]],
      ["token-bucket-take", "k2", "a2", [1, 0]],
      ["semaphore-acquire", "k0", "a0", [1, 8, 2, 10, 0, 0, 0, 99]],
      ["interval-gate-take", "k1", "a1", [1, "150", "160"]],
      ["semaphore-acquire", "k0", "a0", [-2, 0, 2, 10, 0, 0, 0, 99]],
      ["interval-gate-take", "k1", "a1", false],
      ["interval-gate-take", "k0", "a0", [1, "150", "160"]],
    ]);
  });

  it("tells every step no reply when the call's reply is not a list", () => {
    const told: unknown[][] = [];
    ranLate([steps(["semaphore-acquire", "interval-gate-take"], told)], "OK");
    expect(told.map((t) => t[3])).toEqual([undefined, undefined]);
  });
});
