package testutil

import (
	"errors"
	"fmt"
	"time"
)

// ErrNotYet is what a condition of Poll returns to be asked again.
var ErrNotYet = errors.New("not yet")

// NotYet is an error wrapping ErrNotYet that says what is awaited, and what was seen instead.
func NotYet(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrNotYet, fmt.Sprintf(format, args...))
}

// Poll asks cond every interval until it returns nil or an error other than ErrNotYet, which Poll
// returns, or until within has passed: then it returns the last error cond returned, which says
// what was awaited. within is a liveness bound (what is awaited comes in milliseconds; reaching
// the bound means it never came), never a speed bound.
func Poll(within, every time.Duration, cond func() error) error {
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil || !errors.Is(err, ErrNotYet) {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after %v: %w", within, err)
		}
		time.Sleep(every)
	}
}
