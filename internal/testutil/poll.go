package testutil

import (
	"context"
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
// the bound means it never came), never a speed bound. cond is asked at least once.
func Poll(within, every time.Duration, cond func() error) error {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	ended, err := poll(ctx, every, cond)
	if ended {
		return fmt.Errorf("after %v: %w", within, err)
	}
	return err
}

// PollContext is Poll bounded by ctx instead of a duration: when ctx ends, it returns the last
// error cond returned, with why ctx ended.
func PollContext(ctx context.Context, every time.Duration, cond func() error) error {
	ended, err := poll(ctx, every, cond)
	if ended {
		return fmt.Errorf("%w (%w)", err, context.Cause(ctx))
	}
	return err
}

// poll is the loop of Poll and PollContext; ended tells that ctx ended while cond still said
// ErrNotYet.
func poll(ctx context.Context, every time.Duration, cond func() error) (ended bool, err error) {
	for {
		err = cond()
		if err == nil || !errors.Is(err, ErrNotYet) {
			return false, err
		}
		select {
		case <-ctx.Done():
			return true, err
		case <-time.After(every):
		}
	}
}
