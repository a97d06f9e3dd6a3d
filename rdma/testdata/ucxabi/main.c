// Compares the checks evaluated under rdma/ucxabi.h (ours.c) with those evaluated under the
// real UCX headers (real.c); prints every item and exits 1 on any mismatch.
#include <stdio.h>
#include <string.h>

#include "entry.h"

extern const struct ucxabi_entry ucxabi_ours[];
extern const struct ucxabi_entry ucxabi_real[];

static long long value_of(const struct ucxabi_entry *t, const char *name)
{
	for (; t->name != NULL; t++) {
		if (strcmp(t->name, name) == 0) {
			return t->value;
		}
	}
	return -1;
}

int main(void)
{
	// Versioned structs must match exactly when both sides declare the same API version.
	int same_api = value_of(ucxabi_ours, "UCP_API_MINOR") == value_of(ucxabi_real, "UCP_API_MINOR");
	int bad = 0, n = 0;
	for (int i = 0; ucxabi_ours[i].name != NULL; i++, n++) {
		const struct ucxabi_entry *o = &ucxabi_ours[i], *r = &ucxabi_real[i];
		int ok;
		switch (o->kind) {
		case UCXABI_VSIZE:
			ok = same_api ? o->value == r->value : o->value <= r->value;
			break;
		case UCXABI_ATMOST:
			ok = o->value <= r->value;
			break;
		default:
			ok = o->value == r->value && o->size == r->size;
		}
		if (o->size != 0 || r->size != 0) {
			printf("%s %s: ours offset %lld size %lld, ucp.h offset %lld size %lld\n",
			       ok ? "ok  " : "FAIL", o->name, o->value, o->size, r->value, r->size);
		} else {
			printf("%s %s: ours %lld, ucp.h %lld\n", ok ? "ok  " : "FAIL", o->name, o->value,
			       r->value);
		}
		bad += !ok;
	}
	printf("%d checked, %d mismatched\n", n, bad);
	return bad != 0;
}
