package gdrcodec

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A hold whose call ended with no other call in it is being released: its
// drop decided so and unlocked, and release has yet to run. A call that
// starts sending the same message then must not join it (its payloads would
// be withdrawn as soon as they are offered) but take the entry over.
func TestSendDoesNotJoinAHoldBeingReleased(t *testing.T) {
	m := new(int)
	owner := &hold{}
	mine := send(m, owner) // the owner's SendMsg, still under way
	owner.mu.Lock()
	owner.ended = true // as drop leaves it before release runs
	owner.mu.Unlock()

	other := &hold{}
	e := send(m, other)
	require.Same(t, other, e.h, "the other call keeps its payloads in its own hold")
	require.Same(t, other, holdOf(m))
	require.Zero(t, owner.users)

	mine.sent(m)
	require.Same(t, other, holdOf(m), "the owner's send, ending, leaves the new entry")
	e.sent(m)
	require.Nil(t, holdOf(m))
}

// Calls that join a hold keep its payloads until the last of them, the
// hold's own call included, ended.
func TestHoldReleasedByItsLastUser(t *testing.T) {
	m := new(int)
	owner, a, b := &hold{}, &hold{}, &hold{}
	e := send(m, owner)
	require.Same(t, e, send(m, a))
	require.Same(t, e, send(m, b))
	require.Equal(t, 2, owner.users)
	require.True(t, owner.held(), "another call may replay them")
	for range 3 {
		e.sent(m)
	}
	require.Nil(t, holdOf(m))

	owner.end()
	owner.leave() // a's
	require.False(t, owner.done)
	_, to := owner.attempt()
	require.Nil(t, to, "nothing lands for a hold whose call ended")
	owner.leave() // b's
	require.True(t, owner.done)
}
