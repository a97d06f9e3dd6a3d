// One evaluated item of UCXABI_CHECKS (checks.h), and the macros that evaluate the list in
// the translation unit that includes this file.
#ifndef UCXABI_ENTRY_H
#define UCXABI_ENTRY_H

#include <stddef.h>
#include <stdint.h>

enum ucxabi_kind {
	UCXABI_EXACT,  // value and size equal
	UCXABI_VSIZE,  // a versioned struct's size
	UCXABI_ATMOST, // ours no larger
};

struct ucxabi_entry {
	const char *name;
	long long value; // size, offset or constant
	long long size;  // member size for a field, else 0
	enum ucxabi_kind kind;
};

#define UCXABI_E_SIZE(T) {"sizeof(" #T ")", (long long)sizeof(T), 0, UCXABI_EXACT},
#define UCXABI_E_VSIZE(T) {"sizeof(" #T ")", (long long)sizeof(T), 0, UCXABI_VSIZE},
#define UCXABI_E_OPAQUE(T) {"sizeof(" #T " *)", (long long)sizeof(T *), 0, UCXABI_EXACT},
#define UCXABI_E_FIELD(T, m) \
	{#T "." #m, (long long)offsetof(T, m), (long long)sizeof(((T *)0)->m), UCXABI_EXACT},
#define UCXABI_E_CONST(c) {#c, (long long)(c), 0, UCXABI_EXACT},
#define UCXABI_E_ATMOST(c) {#c, (long long)(c), 0, UCXABI_ATMOST},

// UCXABI_TABLE(name) defines name[], the list evaluated here, ended by a NULL name.
#define UCXABI_TABLE(name)                                                              \
	const struct ucxabi_entry name[] = {UCXABI_CHECKS(UCXABI_E_SIZE, UCXABI_E_VSIZE,       \
	                                                  UCXABI_E_OPAQUE, UCXABI_E_FIELD,     \
	                                                  UCXABI_E_CONST, UCXABI_E_ATMOST){0}}

#endif
