// Package nilarg tells a nil argument from a usable one for the packages that take interfaces:
// a nil interface, or an interface holding a nil pointer (a typed nil, such as a nil *pgxpool.Pool
// passed as an Executor), which a plain == nil misses and which would panic on first use.
package nilarg

import (
	"fmt"
	"reflect"
)

// Reason returns "" when v is usable, "is nil" for a nil interface and "is a nil T" (T the
// pointer's type) for a nil pointer: the start of an argument error's reason.
func Reason(v any) string {
	if v == nil {
		return "is nil"
	}
	if rv := reflect.ValueOf(v); rv.Kind() == reflect.Pointer && rv.IsNil() {
		return fmt.Sprintf("is a nil %T", v)
	}
	return ""
}
